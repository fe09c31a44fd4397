"""Failing well: one `error:` line, exit status 1, no traceback, for every failure a user causes.
Bad input raises InputError before anything expensive starts; later a fault (dead actor, broken
reward, non-finite gradient, signal) raises RunError; Ray's shutdown at exit stops every actor."""

import atexit
import os
import signal
import sys
import threading

from common.lifetime import stop_now


class InputError(SystemExit):
    """Bad user input: printed as one line `error: ...`, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


class RunError(InputError):
    """A fault after start-up, printed the same way."""


_STOPPED: list[str] = []  # the signals already stopping the run (stop_on_signals)


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
