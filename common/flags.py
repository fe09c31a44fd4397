"""The command line every script shares: parse_args (one `error:` line for a bad flag, ranges in
--help, --resume keeping the run's flags), the ranges declared in each Args, and the flag groups
every script has and no variant edits, declared once: `class Args(Optimization, LoRA, Engines,
Resources, Experiment)` starts with them (tyro lists them first), then a script adds its own."""

import dataclasses
import difflib
import math
import operator
import os
import pathlib
import re
import sys
import typing
from typing import Annotated, Literal

from common import checkpoint
from common.errors import InputError, stop_on_signals
from common.lifetime import REPO
from common.lora import DEFAULT_TARGETS

_MAIN = getattr(sys.modules["__main__"], "__file__", None) or "run"  # the script being run

RULES = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
INT_MAX = 2**31 - 1  # what torch's and vLLM's int32 counters hold: no integer flag goes past it


def flag_ranges(args_cls) -> dict[str, str]:
    """{field: rule} of each field of a script's Args declared Annotated[type, "> 0, <= 1"]."""
    hints = typing.get_type_hints(args_cls, include_extras=True)
    extras = {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}
    return {name: rule for name, meta in extras.items() for rule in meta if isinstance(rule, str)}


def check_flags(args) -> None:
    """Every flag in its Args range (None: unset), finite (tyro parses "nan", "inf"), <= INT_MAX."""
    for name, rule in flag_ranges(type(args)).items():
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{flag} must be a finite number (got {value})")
        if isinstance(value, int) and abs(value) > INT_MAX:
            raise InputError(f"{flag} must be at most {INT_MAX} (got {value})")
        for op, bound in (part.split() for part in rule.split(",")):
            if not RULES[op](value, float(bound)):
                raise InputError(f"{flag} must be {rule} (got {value})")


def join_repeats(argv: list[str], lists: set[str]) -> list[str]:
    """A list-valued flag given twice takes both: `--f a --f=b c` -> `--f a b c` (argparse: c)."""
    runs, first = [], {}  # each flag with the values after it; the first run of each list flag
    for arg in argv:
        if arg.startswith("--") or not runs:
            runs.append([arg])
        else:
            runs[-1].append(arg)
    for run in runs:
        flag, eq, value = run[0].partition("=")
        if flag in lists:
            values = ([value] if eq else []) + run[1:]
            if flag in first:
                first[flag] += values
                run.clear()
            else:
                run[:] = [flag, *values]
                first[flag] = run
    return [arg for run in runs for arg in run]


def parse_args(args_cls, argv: list[str] | None = None):
    """tyro.cli, but one `error:` line (exit 1) where tyro prints a box and exits 2: a flag not in
    Args (no_flag), no value, a non-number. --help shows ranges; --resume keeps the run's flags."""
    import tyro

    if argv is None:
        stop_on_signals()
    argv = list(sys.argv[1:] if argv is None else argv)
    me = getattr(sys.modules.get(args_cls.__module__), "__file__", "") or ""  # the script
    hints = typing.get_type_hints(args_cls)
    kinds = {"--" + f.name.replace("_", "-"): hints[f.name] for f in dataclasses.fields(args_cls)}
    kinds |= {"--no-" + flag[2:]: bool for flag, kind in kinds.items() if kind is bool}
    lists = {flag for flag, kind in kinds.items() if typing.get_origin(kind) in (tuple, list)}
    argv = join_repeats(argv, lists)
    for i, arg in enumerate(argv, 1):  # argv[i]: the one after arg
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or flag == "--help":
            continue  # -h, --help, a flag's value (never --...) and anything else: tyro's
        if flag not in kinds:
            raise InputError(no_flag(flag, kinds, me))
        if kinds[flag] is bool:
            continue
        if not eq:
            if i == len(argv) or argv[i].startswith("--"):
                raise InputError(f"{flag} needs a value")
            value = argv[i]
        types = typing.get_args(kinds[flag]) or (kinds[flag],)  # a Literal's: its choices
        if typing.get_origin(kinds[flag]) is typing.Literal and value not in types:
            raise InputError(f"{flag} takes one of {', '.join(types)} (got {value!r})")
        for number, what in ((int, "an integer"), (float, "a number")):
            if number in types and not (value == "None" and type(None) in types):
                try:
                    number(value)
                except ValueError:
                    raise InputError(f"{flag} takes {what} (got {value!r})") from None
                break
    for name, rule in flag_ranges(args_cls).items() if {"-h", "--help"} & set(argv) else ():
        hint = tyro.conf.arg(help_behavior_hint=lambda d, r=rule: f"(default: {d}; {r})")
        owner = next(c for c in args_cls.__mro__ if name in vars(c).get("__annotations__", {}))
        owner.__annotations__[name] = typing.Annotated[owner.__annotations__[name], hint]
    args = tyro.cli(args_cls, args=argv)
    if getattr(args, "resume", None):
        checkpoint.keep_run_settings(args, checkpoint.flag_names(argv), os.path.basename(me))
    if getattr(args, "save_final", True) is False and getattr(args, "save_every", 1) == 0:
        print(
            "note: this run saves no model (--no-save-final, --save-every 0): what it learns is "
            "lost when it ends; keep final/ or pass --save-every N to keep it"
        )
    return args


def no_flag(flag: str, kinds: dict, script: str) -> str:
    """The line for a flag `script` lacks: the scripts that have it (Args read as text) and why not
    here where its Args say (`# ... no --flag: why`); else the closest of its own."""

    def args_text(path):  # a script's `class Args` block, as text
        text = pathlib.Path(path).read_text(errors="replace")
        return text.partition("\nclass Args")[2].partition("\n\n\n")[0]

    name = flag.removeprefix("--no-") if flag.startswith("--no-") else flag[2:]
    field = re.compile(rf"^    {name.replace('-', '_')}: ", re.M)
    have = [
        s
        for s in sorted(os.listdir(REPO), key=lambda s: (s != "grpo.py", s))  # parent first
        if s.endswith(".py")
        and s != os.path.basename(script)
        and field.search(args_text(os.path.join(REPO, s)))
    ]
    if not have:
        close = difflib.get_close_matches(flag, kinds, n=1)
        return f"no flag {flag}{f' (did you mean {close[0]}?)' if close else ''}; --help lists them"
    why = re.search(rf"# .*\bno --{name}: (.+)", args_text(script)) if script else None
    here = os.path.basename(script) + (f": {why[1]}" if why else "")
    has = ", ".join(have) + (" has" if len(have) == 1 else " have")
    return f"no flag {flag} in {here}; {has} it (python {have[0]} {flag})"


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
    best_metric: str | None = None
    """keep checkpoints/best, the weights of the evaluation that did best on this eval/ metric (e.g.
    eval/accuracy; its step and value in checkpoint.json)"""
    best_mode: Literal["max", "min"] = "max"
    """--best-metric: higher (max) or lower (min) is better"""


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
            raise InputError(
                f"--num-trainers {self.num_trainers} is not a multiple of --sp-size {self.sp_size}"
            )
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
class LoRA:  # what trains: LoRA's adapters on a frozen base model (off by default), a VLM's tower
    lora_rank: Annotated[int, ">= 0, <= 512"] = 0  # vLLM's limit (lora.VLLM_RANKS)
    """r: train LoRA adapters of this rank on the frozen model (0: train every weight); only the
    adapters reach the optimizer (and the engines)"""
    lora_alpha: Annotated[float | None, "> 0"] = None
    """α: the adapters' output is scaled by α / r (default 2 r)"""
    lora_dropout: Annotated[float, ">= 0, < 1"] = 0.0
    """dropout on the adapters' input (keep 0 in RL: it would make π_θ random)"""
    lora_target_modules: str = DEFAULT_TARGETS
    """comma-separated linear layers of each decoder layer that get adapters"""
    train_vision: bool = False
    """a vision-language --model: train its vision tower too (default: frozen; the connector and
    the language model learn; docs/vision.md)"""


@dataclasses.dataclass
class Optimization:  # the trainer shell's (common/trainer.py, common/optim.py); docs/weights.md
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw; muon (Jordan 2024): the decoder layers' 2-D matrices step by their orthogonalised
    momentum, AdamW the rest (embeddings, head, norms, biases)"""
    warmup_steps: Annotated[int, ">= 0"] = 2
    """linear warm-up steps, then cosine decay"""
    min_lr_ratio: Annotated[float, ">= 0, <= 1"] = 0.1
    """the cosine decays to learning_rate * min_lr_ratio"""
    weight_decay: Annotated[float, ">= 0"] = 0.0
    """decoupled weight decay (AdamW's, Muon's)"""
    max_grad_norm: Annotated[float, "> 0"] = 1.0
    """clip the global gradient norm to this"""
    ema_beta: Annotated[float, ">= 0, < 1"] = 0.0
    """β_ema: θ_ema ← β_ema θ_ema + (1 - β_ema) θ after each optimizer step, saved in every
    checkpoint's ema/ (an HF folder) and resumed (0: off)"""
    eval_ema: bool = False
    """evaluate θ_ema, not θ (needs --ema-beta); --best-metric then ranks θ_ema"""

    def check_together(self):
        """The shared groups' flags that need each other (checkpoint.check_start calls it, after a
        script's own checks: grpo_async.py refuses --eval-ema whatever --ema-beta says)."""
        if self.best_metric is not None and not re.fullmatch(r"eval/\S+", self.best_metric):
            raise InputError(f"--best-metric must be eval/<name> (got {self.best_metric!r})")
        if self.eval_ema and not self.ema_beta:
            raise InputError("--eval-ema needs --ema-beta (the EMA is off)")
        if getattr(self, "lora_rank", 0) and (self.ema_beta or self.optimizer == "muon"):
            flag = "--ema-beta averages" if self.ema_beta else "--optimizer muon orthogonalises"
            raise InputError(f"{flag} whole matrices, not LoRA's adapters: leave out --lora-rank")
