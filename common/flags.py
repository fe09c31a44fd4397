"""The flag groups every script has and no variant edits, declared once: `class Args(LoRA, Engines,
Resources, Experiment)` starts with them (tyro lists them first), then a script adds its own."""

import dataclasses
import os
import sys
from typing import Annotated, Literal

from common.errors import InputError
from common.lora import DEFAULT_TARGETS

_MAIN = getattr(sys.modules["__main__"], "__file__", None) or "run"  # the script being run


@dataclasses.dataclass
class Experiment:
    exp_name: str = os.path.basename(_MAIN).removesuffix(".py")  # grpo for `python grpo.py`
    """name of the experiment; runs go to <output-dir>/<exp-name>__<seed>__<unix time>"""
    seed: Annotated[int, ">= 0"] = 1
    """seed of model init, data order and sampling"""
    track: bool = False
    """log metrics to Weights & Biases"""
    wandb_project: str = "posttrain"
    """the wandb project"""
    output_dir: str = "runs"
    """folder for run directories"""
    resume: str | None = None
    """continue a run: its run dir (latest checkpoint) or one of its checkpoints/step_N"""
    save_every: Annotated[int, ">= 0"] = 0
    """save a resumable checkpoint every N steps (0: only the final model)"""
    save_final: bool = True
    """write checkpoints/final (HF format) at the end; the labs skip it with --no-save-final"""
    eval_every: Annotated[int, ">= 1"] = 10
    """evaluate every N steps, and before the first and after the last"""


@dataclasses.dataclass
class Resources:
    num_trainers: Annotated[int, ">= 1"] = 1
    """FSDP2 trainer ranks (one GPU each on GPU; share the cores on CPU)"""
    sp_size: Annotated[int, ">= 1"] = 1
    """ring attention: split every packed row over this many ranks (trainer ranks = DP x this)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, ~30% more compute"""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """GPU compute dtype, master weights in fp32 (auto: bfloat16, float16 below compute capability
    8.0 as on a T4); engines and weight sync use it too. CPU: float32"""

    def dp_size(self) -> int:
        """Data-parallel groups: the trainer ranks in sequence-parallel groups of --sp-size."""
        if self.num_trainers % self.sp_size:
            raise InputError(f"--num-trainers {self.num_trainers} is not a multiple of --sp-size "
                             f"{self.sp_size}")  # fmt: skip
        return self.num_trainers // self.sp_size


@dataclasses.dataclass
class Engines:  # the RL scripts'
    num_engines: Annotated[int, ">= 1"] = 1
    """vLLM engines (Ray actors) generating rollouts"""
    engine_tp: Annotated[int, ">= 1"] = 1
    """tensor-parallel GPUs per engine"""
    engine_memory: Annotated[float | None, "> 0"] = None
    """GPU: fraction of GPU memory for vLLM (default 0.85, colocated 0.4); CPU: GiB of KV cache
    (default 1)"""
    lora_merge_sync: bool = False
    """LoRA: send the engines merged weights, not the adapters (for models vLLM has no LoRA for)"""


@dataclasses.dataclass
class LoRA:  # off by default: adapters on a frozen base model, common/lora.py
    lora_rank: Annotated[int, ">= 0, <= 512"] = 0  # vLLM's limit (lora.VLLM_RANKS)
    """r: train LoRA adapters of this rank on the frozen model (0: train every weight); only the
    adapters reach the optimizer (and the engines)"""
    lora_alpha: Annotated[float | None, "> 0"] = None
    """α: the adapters' output is scaled by α / r (default 2 r)"""
    lora_dropout: Annotated[float, ">= 0, < 1"] = 0.0
    """dropout on the adapters' input (keep 0 in RL: it would make π_θ random)"""
    lora_target_modules: str = DEFAULT_TARGETS
    """comma-separated linear layers of each decoder layer that get adapters"""
