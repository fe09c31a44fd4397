"""Failing well: one `error:` line, exit status 1, no traceback, for every failure a user causes.
Bad input raises InputError before anything expensive starts; later a fault (dead actor, broken
reward, non-finite gradient, signal) raises RunError; Ray's shutdown at exit stops every actor."""

import atexit
import dataclasses
import difflib
import math
import operator
import os
import pathlib
import re
import signal
import sys
import threading
import typing

from common.lifetime import REPO, stop_now


class InputError(SystemExit):
    """Bad user input: printed as one line `error: ...`, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


class RunError(InputError):
    """A fault after start-up, printed the same way."""


RULES = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
INT_MAX = 2**31 - 1  # what torch's and vLLM's int32 counters hold: no integer flag goes past it
_STOPPED: list[str] = []  # the signals already stopping the run (stop_on_signals)


def flag_ranges(args_cls) -> dict[str, str]:
    """{field: rule} of each field of a script's Args declared Annotated[type, "> 0, <= 1"]."""
    hints = typing.get_type_hints(args_cls, include_extras=True)
    extras = {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}
    return {name: rule for name, meta in extras.items() for rule in meta if isinstance(rule, str)}


def check_ranges(args) -> None:
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
    from common import checkpoint  # it imports this module

    if getattr(args, "resume", None):
        checkpoint.keep_run_settings(args, checkpoint.flag_names(argv), os.path.basename(me))
    if getattr(args, "save_final", True) is False and getattr(args, "save_every", 1) == 0:
        print("note: this run saves no model (--no-save-final, --save-every 0): what it learns is "
              "lost when it ends; keep final/ or pass --save-every N to keep it")  # fmt: skip
    return args


def no_flag(flag: str, kinds: dict, script: str) -> str:
    """The line for a flag `script` lacks: the scripts that have it (Args read as text) and why not
    here where its Args say (`# ... no --flag: why`); else the closest of its own."""
    args_text = lambda path: pathlib.Path(path).read_text(errors="replace").partition(  # noqa: E731
        "\nclass Args")[2].partition("\n\n\n")[0]  # fmt: skip
    name = flag.removeprefix("--no-") if flag.startswith("--no-") else flag[2:]
    field = re.compile(rf"^    {name.replace('-', '_')}: ", re.M)
    have = [s for s in sorted(os.listdir(REPO), key=lambda s: (s != "grpo.py", s))  # parent first
            if s.endswith(".py") and s != os.path.basename(script)
            and field.search(args_text(os.path.join(REPO, s)))]  # fmt: skip
    if not have:
        close = difflib.get_close_matches(flag, kinds, n=1)
        return f"no flag {flag}{f' (did you mean {close[0]}?)' if close else ''}; --help lists them"
    why = re.search(rf"# .*\bno --{name}: (.+)", args_text(script)) if script else None
    here = os.path.basename(script) + (f": {why[1]}" if why else "")
    has = ", ".join(have) + (" has" if len(have) == 1 else " have")
    return f"no flag {flag} in {here}; {has} it (python {have[0]} {flag})"


def stop_on_signals() -> None:
    """SIGTERM and Ctrl-C end the run as a fault in any phase: exit status 1, one line printed last
    once every run process has ended (also when all got the signal: SLURM, a terminal). The handler
    only exits (raised in the driver's wait in Ray, a message is lost); a second signal: at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, what in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")):

        def stop(*_, what=what):
            if _STOPPED:  # a second one: at once (common/lifetime.py's watchdog ends the rest)
                line = f"stopped at once by a second {what}: a checkpoint being written is dropped"
                print(f"error: {line}, the newest whole one stays", file=sys.stderr, flush=True)
                os._exit(1)
            _STOPPED.append(what)
            atexit.register(_last_line, what)  # runs before Ray's own exit hook
            raise SystemExit(1)

        signal.signal(sig, stop)


def _last_line(what: str) -> None:
    if (ray := sys.modules.get("ray")) and ray.is_initialized():  # every process of it ends first
        stop_now(f"error: stopped by {what}")
    print(f"error: stopped by {what}", file=sys.stderr, flush=True)
