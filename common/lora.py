"""LoRA (Hu et al. 2021, arXiv 2106.09685): train low-rank adapters on a frozen base model,
    W' = W + (α / r) B A,      A (r x in) random, B (out x r) zero at the start,
so a run starts at the base model and trains r (in + out) numbers per matrix, not in x out. PEFT's
layers go in before FSDP2 shards; they (and a new head) train, the base keeps the training dtype: no
gradient, no AdamW state. π_ref: adapters off (`Disabled`). Engines: adapters or merged weights."""

import copy
import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from common.errors import InputError

ADAPTER = "adapter"  # a checkpoint's adapter folder
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank must be one of these
PREFIX = "base_model.model."  # PEFT's file keys: base_model.model.<name>, no adapter name


def targets(args) -> list[str]:
    return [t.strip() for t in args.lora_target_modules.split(",") if t.strip()]


def alpha(args) -> float:
    """--lora-alpha, by default 2 r (a scale α / r of 2 at any rank)."""
    return args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank


def check_args(args) -> None:
    """The LoRA flags, alone and together (pure: validate_args calls it)."""
    given = [
        f
        for f in ("lora_alpha", "lora_dropout", "lora_merge_sync", "lora_target_modules")
        if getattr(args, f, None) not in (None, 0, False, DEFAULT_TARGETS)
    ]
    if given and not args.lora_rank:  # a LoRA flag given without it would be ignored in silence
        raise InputError(f"--{given[0].replace('_', '-')} needs --lora-rank (LoRA is off)")
    if args.lora_rank and not targets(args):
        raise InputError("--lora-target-modules is empty: name the linear layers to adapt")


def check_model(args, model_path: str, name: str) -> None:
    """Each target is a linear layer in every decoder layer (checked on meta: no weights read);
    `name`: the model as the user gave it (--model), for the message."""
    if not args.lora_rank:
        return
    with torch.device("meta"):  # the decoder without a head: the same for an LM and a scorer
        model = AutoModel.from_config(AutoConfig.from_pretrained(model_path))
    if (layers := getattr(model.get_decoder(), "layers", None)) is None:
        raise InputError(f"--lora-rank: {name} has no decoder layers at .layers")
    linear = {
        name.rsplit(".", 1)[-1]
        for name, m in layers[0].named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    if missing := [t for t in targets(args) if t not in linear]:
        have = ", ".join(sorted(linear))
        raise InputError(
            f"--lora-target-modules: {name} has no linear layer {missing[0]!r} "
            f"in its decoder layers (they have: {have})"
        )


@dataclass
class Adapters:
    config: object  # peft.LoraConfig
    base: str  # the frozen base model's folder
    resume: str | None = None  # the checkpoint to start them from (--resume); None: fresh
    whole: tuple[str, ...] = ()  # modules trained whole (a score head), with no PEFT wrapper

    def add(self, model, dtype) -> None:
        """Inject the adapters (meta, before FSDP2); freeze the rest in `dtype` (no fp32 copy)."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(copy.deepcopy(self.config), model, low_cpu_mem_usage=True)
        model.peft_config["default"].modules_to_save = list(self.whole) or None
        for name, param in model.named_parameters():  # trained: the adapters, a whole head
            param.requires_grad_(".lora_" in name or name.split(".")[0] in self.whole)
            if not param.requires_grad:
                param.data = param.data.to(dtype)

    def fill(self, source) -> None:
        """The same adapters on rank 0's full copy (trainer.load_weights): fresh, or resumed."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(self.config, source)
        if self.resume is None:
            return
        saved = load_file(os.path.join(self.resume, ADAPTER, "adapter_model.safetensors"))
        params = {PREFIX + n.replace(".default.", "."): p for n, p in source.named_parameters()}
        with torch.no_grad():
            for key, tensor in saved.items():  # PEFT's file keys, as adapter_tensors writes them
                params[key].copy_(tensor)


def adapters(args, base: str, path: str, whole=()) -> Adapters | None:
    """The LoRA flags' adapters on the frozen `base` (None when --lora-rank is 0), resumed from
    `path` if it differs; `whole`: modules trained whole (a score head)."""
    if not args.lora_rank:
        return None
    from peft import LoraConfig

    from common.vision import is_vlm

    modules = targets(args)
    if is_vlm(base, base):  # the language model's layers only (the vision tower has a q_proj too)
        modules = rf".*\.text_model\.layers\.\d+\..*\.({'|'.join(modules)})"
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=alpha(args),
        lora_dropout=args.lora_dropout,
        target_modules=modules,
        base_model_name_or_path=base,
    )
    return Adapters(config, base, path if path != base else None, tuple(whole))


def on(model) -> bool:
    return hasattr(model, "peft_config")


class Disabled:
    """π_ref, no second copy: the policy called with its adapters off (attributes read through)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:  # weights untouched
            layer.enable_adapters(False)
        try:
            return self.model(*args, **kwargs)
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def __getattr__(self, name):
        return getattr(self.model, name)


def adapter_tensors(model, dtype=None) -> dict:
    """{key in adapter_model.safetensors: gathered CPU copy (not an FSDP2 view)} of each trained
    param, in `dtype` if given (all ranks call it)."""
    return {
        PREFIX + n.replace(".default.", "."): full_tensor(p).to("cpu", dtype, copy=True)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def write_adapter(folder: str, tensors: dict, config: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    file = os.path.join(folder, "adapter_model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, file, metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def config_dict(model) -> dict:
    """The adapter_config.json of a model with adapters (PEFT's fields; sets as sorted lists)."""
    config = model.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def merged(tensors: dict, model, dtype=None):
    """(HF name, W + (α / r) B A, or W) for each weight of `tensors` but the adapters', in `dtype`
    (None: W's own): a state dict, or named parameters (FSDP2 shards all-gathered: collectives)."""
    for name in [n for n in tensors if ".lora_" not in n]:
        tensor = weight = full_tensor(tensors[name])
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner and leaf == "weight":
            a, b = (full_tensor(tensors[f"{owner}.lora_{x}.default.weight"]) for x in "AB")
            scale = model.get_submodule(owner).scaling["default"]  # α / r of this LoRA layer
            tensor = weight.float() + scale * (b.float() @ a.float())
        yield name.replace(".base_layer.", "."), tensor.to(dtype or weight.dtype)


def full_tensor(param):
    """`param` detached, whole: an FSDP2 shard is all-gathered (a collective)."""
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param
