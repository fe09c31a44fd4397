"""Failing well: one `error:` line, exit status 1 and no traceback, for every failure a user causes.

Before anything expensive starts, bad input raises InputError: nothing has been written. After Ray
starts, a fault (an actor that died, a reward function that raised, hung or returned NaN, a
non-finite gradient, a signal) raises RunError: the same one line, and the exit runs Ray's shutdown,
which stops every actor; checkpoints already written stay. Flag ranges are declared on the flags
themselves (`Annotated[int, ">= 1"]` in each script's Args) and checked here."""

import math
import operator
import signal
import threading
import typing


class InputError(SystemExit):
    """Bad user input: printed as one line `error: ...`, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


class RunError(SystemExit):
    """A fault after start-up: printed as one line `error: ...`, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


RULES = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def flag_ranges(args_cls) -> dict[str, str]:
    """{field: rule} of each field of a script's Args declared Annotated[type, "> 0, <= 1"]."""
    hints = typing.get_type_hints(args_cls, include_extras=True)
    extras = {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}
    return {name: rule for name, meta in extras.items() for rule in meta if isinstance(rule, str)}


def check_ranges(args) -> None:
    """Every flag within the range declared on it in Args. None means unset. NaN and infinities are
    rejected for every float flag (tyro parses "nan" and "inf" as floats)."""
    for name, rule in flag_ranges(type(args)).items():
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{flag} must be a finite number (got {value})")
        for part in rule.split(","):
            op, bound = part.split()
            if not RULES[op](value, float(bound)):
                raise InputError(f"{flag} must be {rule} (got {value})")


def stop_on_signals() -> None:
    """SIGTERM and Ctrl-C end the run as a fault: one line, then Ray's shutdown stops the actors."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, what in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")):

        def stop(*_, what=what):
            raise RunError(f"stopped by {what}")

        signal.signal(sig, stop)
