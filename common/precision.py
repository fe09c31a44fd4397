"""The floating-point format a run computes in, chosen once from the GPU; float16's loss scaling.
CPU: float32 everywhere. GPU: master weights, gradient reduction and AdamW stay float32; FSDP2's
MixedPrecisionPolicy casts each layer to the compute dtype: --dtype, or bfloat16 from compute
capability 8.0 (Ampere) and float16 below (7.5: Colab's T4). The engines, weights sent to them,
LoRA's frozen base and the memory plan use it too. float16's 5 exponent bits flush gradients below
~6e-8 to 0, so the loss is scaled by S before backward and the gradients divided by S after (dynamic
loss scaling, Micikevicius et al. 2018, arXiv 1710.03740, section 3.2; as torch's GradScaler)."""

import os
import subprocess

import torch

from common.errors import InputError

OLDEST = (7, 5)  # the pinned CUDA 13 builds of torch and vLLM run on Turing (T4) and newer
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# model types vLLM 0.32 refuses to serve in float16 ("numerical instability", vllm/config/model.py)
NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text", "glm4")


def first_gpu(*fields: str) -> list[str] | None:
    """nvidia-smi's `fields` of the first visible GPU (no CUDA started); None if it cannot tell."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"  # index or UUID
    query = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([*query, "-i", first], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [v.strip() for v in out.stdout.strip().split("\n")[0].split(",")]
    return values if out.returncode == 0 and len(values) == len(fields) else None


def check_gpu(dtype: str, name: str, capability: tuple[int, int]) -> str:
    """The dtype to compute in on this GPU (--dtype; "auto" chooses), or one line saying why not."""
    cc = "{}.{}".format(*capability)
    if tuple(capability) < OLDEST:
        raise InputError(
            f"the {name} (compute capability {cc}) is older than the pinned CUDA 13 "
            "build of torch and vLLM supports (7.5 and newer: T4, A10, L4, A100, "
            "H100, ...); use one of those, or the CPU stack: "
            "POSTTRAIN_CPU=1 make demo"
        )
    if dtype == "auto":
        return "bfloat16" if tuple(capability) >= (8, 0) else "float16"
    if dtype == "bfloat16" and tuple(capability) < (8, 0):
        raise InputError(
            f"--dtype bfloat16 needs compute capability 8.0 or newer (Ampere); the "
            f"{name} has {cc}: use --dtype float16 (its default) "
            "or float32"
        )
    return dtype


def choose_dtype(dtype: str, use_gpu: bool) -> str:
    """The driver's --dtype made concrete before anything starts (printed on GPU), or why not."""
    if not use_gpu:
        if dtype not in ("auto", "float32"):
            raise InputError(f"--dtype {dtype} needs a GPU: on CPU every model runs in float32")
        return "float32"
    gpu = first_gpu("name", "compute_cap")
    if gpu is None:  # a driver on a node without GPUs (a Ray cluster): each trainer checks its own
        chosen = "bfloat16" if dtype == "auto" else dtype
        where = "the GPUs are not visible here; below compute capability 8.0: --dtype float16"
    else:
        chosen = check_gpu(dtype, gpu[0], tuple(int(x) for x in gpu[1].split(".")))
        where = f"{gpu[0]}, compute capability {gpu[1]}"
    scaled = ", dynamic loss scaling" if chosen == "float16" else ""
    print(f"precision: {chosen} compute, fp32 master weights{scaled} ({where})", flush=True)
    return chosen


def check_served_in(dtype: str, config) -> None:
    """The engines will serve this model (an HF config) in the run's dtype, or one line why not."""
    kinds = {config.model_type, config.get_text_config().model_type}
    if dtype == "float16" and (kind := next((k for k in kinds if k in NO_FLOAT16), None)):
        raise InputError(
            f"vLLM does not serve {kind} models in float16 (numerical instability), the dtype of "
            "this run (--dtype float16, or a GPU older than Ampere): use --dtype float32"
        )


def compute_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """A trainer's or engine's dtype: the driver's, rechecked on a GPU the driver may not see."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dtype = check_gpu(dtype, name, torch.cuda.get_device_capability(device))
    return getattr(torch, "float32" if dtype == "auto" else dtype)


class LossScale:
    """Dynamic loss scaling for float16 (S = 1 otherwise; from 2^16, as GradScaler). skip(): a
    non-finite grad norm halves S and skips the step; `interval` good updates double S."""

    def __init__(self, dtype: torch.dtype, scale: float = 2.0**16, interval: int = 1000):
        self.on = dtype == torch.float16
        self.value, self.interval, self.good = scale if self.on else 1.0, interval, 0

    def backward(self, loss: torch.Tensor) -> None:
        if self.on and not torch.isfinite(loss):  # the forward overflowed: no scale can help
            raise FloatingPointError(
                "a non-finite loss in float16: the model's forward pass overflows float16 "
                "(Qwen-family models do); use --dtype float32 (or bfloat16 on Ampere and newer)"
            )
        (loss * self.value).backward()

    def state_dict(self) -> dict:  # in the checkpoint: a resumed run goes on at the same scale
        return {"value": self.value, "good": self.good}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.good = state["value"], state["good"]

    @torch.no_grad()
    def unscale(self, params) -> None:  # divide the gradients by S, before they are clipped
        for p in params if self.on else ():
            if p.grad is not None:
                p.grad.div_(self.value)

    def skip(self, grad_norm: torch.Tensor, step: int) -> bool:
        if not self.on:
            return False
        if torch.isfinite(grad_norm):
            self.good += 1
            if self.good % self.interval == 0:
                self.value *= 2
            return False
        if self.value <= 1:  # an overflow not of the scale's doing: the forward pass's
            raise FloatingPointError(
                "non-finite gradients in float16 at a loss scale of 1 at "
                f"step {step + 1}: the model overflows float16; use "
                "--dtype float32"
            )
        self.value, self.good = self.value / 2, 0
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(
                f"step {step + 1}: float16 gradients overflowed: no update, loss scale now "
                f"{self.value:g}",
                flush=True,
            )
        return True
