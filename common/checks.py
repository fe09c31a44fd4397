"""Failing well: flag ranges and run-directory checks before anything starts, one line for faults after it.

Before Ray starts, bad input raises InputError (common/data.py): one `error: ...` line, exit status 1, nothing
written. After it starts, a fault (an actor that died, a reward function that raised, hung or returned NaN, a
non-finite gradient) raises RunError: the same one line, and the exit runs Ray's shutdown, which stops every
actor; checkpoints already written stay as they are.
"""

import math
import netrc
import numbers
import os
import signal
import tempfile
import threading
import zipfile
from urllib.parse import urlparse

from common.data import InputError

RULES = {">=": lambda v, a: v >= a, ">": lambda v, a: v > a, "<=": lambda v, a: v <= a, "<": lambda v, a: v < a}


class RunError(SystemExit):
    """A fault after start-up: printed as one line `error: ...`, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


def check_ranges(args, rules: dict[str, str]) -> None:
    """Every flag within its range: {rule: flag names}, e.g. {">= 1": "num_steps batch_size", "> 0, <= 1": "top_p"}.

    None means unset. NaN and infinities are rejected for every float flag (tyro parses "nan" and "inf" as floats).
    """
    for rule, names in rules.items():
        for name in names.split():
            value, flag = getattr(args, name), "--" + name.replace("_", "-")
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"{flag} must be a finite number (got {value})")
            for part in rule.split(","):
                op, bound = part.split()
                if not RULES[op](value, float(bound)):
                    raise InputError(f"{flag} must be {rule} (got {value})")


def check_weights(path: str, what: str) -> None:
    """A model folder holds its weights, whole: model.safetensors, its shards per the index, or pytorch_model.bin.

    A safetensors file is checked against its own header (data offsets vs file size), so a truncated copy is
    found without reading it.
    """
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

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
        if not os.path.isfile(file) or not _whole(file):
            raise InputError(f"{what} {path}: {name} is missing or truncated")


def _whole(file: str) -> bool:
    if file.endswith(".bin"):
        return zipfile.is_zipfile(file)  # torch.save's format: a truncated file has no central directory
    import json

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


def check_output_dir(path: str) -> None:
    """--output-dir is (or can become) a writable folder; nothing is left behind here."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"--output-dir {path}: {existing} is a file, not a folder")
    try:  # a real write: permission bits say nothing for root, nor for a read-only filesystem
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise InputError(f"--output-dir {path}: cannot write in {existing} ({e.strerror})") from None


def check_tracking(track: bool) -> None:
    """--track needs wandb and a login (WANDB_API_KEY, `wandb login`'s netrc entry) or WANDB_MODE=offline."""
    if not track:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise InputError("--track needs the package wandb (pip install wandb)")
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        login = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        login = None
    if not login:
        raise InputError(
            "--track: no Weights & Biases login; run `wandb login`, set WANDB_API_KEY or WANDB_MODE=offline"
        )


def check_checkpoint(checkpoint: str) -> None:
    """A --resume checkpoint is whole: its weights (check_weights) and trainer_state.pt (a zip archive)."""
    check_weights(checkpoint, "--resume: checkpoint")
    if not zipfile.is_zipfile(os.path.join(checkpoint, "trainer_state.pt")):
        raise InputError(f"--resume: {checkpoint}/trainer_state.pt is truncated or not a checkpoint")


def call_reward(fn, pairs: list[tuple[str, str]], where: str, timeout: float, labels: list[str] | None = None):
    """fn(response, answer) for each pair -> list of floats, in this (the main) thread: math-verify's own timeouts
    need it. A call that raises, runs over `timeout` seconds, or returns anything but a finite number stops the
    run with one line naming the function, `where` (e.g. "step 3") and the pair (`labels[i]`, or its row).
    """
    name = getattr(fn, "__name__", repr(fn))

    class Late(BaseException):  # BaseException: a reward function's `except Exception` does not swallow it
        pass

    def late(*_):
        raise Late

    previous = signal.signal(signal.SIGUSR1, late)
    out = []
    try:
        for row, (response, answer) in enumerate(pairs, 1):
            at = f"{where}, {labels[row - 1]}" if labels else f"{where}, row {row}"
            # the signal goes to the main thread itself, so a call blocked in sleep() or I/O is interrupted too
            timer = threading.Timer(timeout, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
            timer.start()
            try:
                value = fn(response, answer)
            except Late:
                raise RunError(f"reward function {name} did not return within {timeout:g} s ({at})") from None
            except Exception as e:
                raise RunError(f"reward function {name} failed ({at}): {type(e).__name__}: {e}") from None
            finally:
                timer.cancel()
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RunError(f"reward function {name} returned {value!r}, not a finite number ({at})")
            out.append(float(value))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return out


def stop_on_signals() -> None:
    """SIGTERM (and Ctrl-C) end the run as a fault: one line, then Ray's shutdown stops every actor."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, what in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")):

        def stop(*_, what=what):
            raise RunError(f"stopped by {what}")

        signal.signal(sig, stop)
