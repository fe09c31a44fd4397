"""The floating-point format a run computes in, chosen once from the GPU; float16's loss scaling.

CPU: float32 everywhere. GPU: the master weights, the gradients' reduction and AdamW stay float32;
FSDP2's MixedPrecisionPolicy casts each layer to the compute dtype for its forward and backward.
That dtype is bfloat16 where the GPU has it (compute capability 8.0: Ampere, and newer) and float16
below (7.5: the T4 of Colab and Kaggle), or what --dtype says; the vLLM engines run in it, the
weights travel to them in it, LoRA's frozen base is stored in it, the memory plan counts it.

float16 has 5 exponent bits: gradients below ~6e-8 underflow to 0. So the loss is multiplied by a
scale S before the backward pass and the gradients divided by S after it (dynamic loss scaling,
Micikevicius et al. 2018, arXiv 1710.03740, section 3.2; torch's GradScaler does the same)."""

import os
import subprocess

import torch

from common.errors import InputError

OLDEST = (7, 5)  # the pinned CUDA 13 builds of torch and vLLM run on Turing (T4) and newer
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def first_gpu(*fields: str) -> list[str] | None:
    """nvidia-smi's `fields` (e.g. "name", "compute_cap") of the first visible GPU, read without
    starting CUDA in this process; None where nvidia-smi cannot tell (no GPU on this node)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"  # index or UUID
    query = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([*query, "-i", first], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [v.strip() for v in out.stdout.strip().split("\n")[0].split(",")]
    return values if out.returncode == 0 and len(values) == len(fields) else None


def check_gpu(dtype: str, name: str, capability: tuple[int, int]) -> str:
    """The dtype to compute in on this GPU (`dtype`: --dtype, "auto" chooses); what it cannot run
    stops here in one line, naming the GPU and what would work."""
    cc = "{}.{}".format(*capability)
    if tuple(capability) < OLDEST:
        raise InputError(
            f"the {name} (compute capability {cc}) is older than the pinned CUDA 13 build of torch "
            "and vLLM supports (7.5 and newer: T4, A10, L4, A100, H100, ...); use one of those, or "
            "the CPU stack: POSTTRAIN_CPU=1 make demo"
        )
    if dtype == "auto":
        return "bfloat16" if tuple(capability) >= (8, 0) else "float16"
    if dtype == "bfloat16" and tuple(capability) < (8, 0):
        raise InputError(
            f"--dtype bfloat16 needs compute capability 8.0 or newer (Ampere); the {name} has "
            f"{cc}: use --dtype float16 (its default) or float32"
        )
    return dtype


def choose_dtype(dtype: str, use_gpu: bool) -> str:
    """The driver, before anything starts: --dtype made concrete for this run (the trainers and
    engines get it in args), or one line saying why it cannot run. Printed on GPU."""
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


def compute_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """What a trainer or engine on `device` computes in: `dtype` as the driver chose it ("auto":
    chosen here, float32 on CPU), checked again on a GPU (a cluster's driver may not see them)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dtype = check_gpu(dtype, name, torch.cuda.get_device_capability(device))
    return getattr(torch, "float32" if dtype == "auto" else dtype)


def mixed_precision(dtype: torch.dtype):
    """FSDP2's policy: compute in `dtype`, keep the master weights and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # not on import: the engines' side

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class LossScale:
    """Dynamic loss scaling for float16 compute (S = 1 for another dtype); unscale() divides the
    gradients by S before they are clipped. skip(grad_norm, step): a non-finite norm means the
    scaled gradients overflowed float16: S halves, the optimizer does not step; after `interval`
    updates in a row without overflow S doubles. S starts at 2^16 (GradScaler's). An overflow at a
    scale of 1 is not the scale's doing (the forward pass overflows): it stops the run."""

    def __init__(self, dtype: torch.dtype, scale: float = 2.0**16, interval: int = 1000):
        self.on = dtype == torch.float16
        self.value, self.interval, self.good = scale if self.on else 1.0, interval, 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.value).backward()

    @torch.no_grad()
    def unscale(self, params) -> None:
        if self.on:
            for p in params:
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
        if self.value <= 1:
            raise FloatingPointError(
                f"non-finite gradients in float16 at a loss scale of 1 at step {step + 1}: the "
                "model overflows float16; use --dtype float32"
            )
        self.value, self.good = self.value / 2, 0
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"step {step + 1}: float16 gradients overflowed: no update, loss scale now "
                  f"{self.value:g}", flush=True)  # fmt: skip
        return True
