"""The reward harness: a reward function called for every sampled response, guarded so that a
broken one (a raise, a hang, a non-number) ends the run with a line naming it, the step, the row."""

import math
import numbers
import signal
import threading

from common.errors import RunError


def call_reward(fn, pairs: list[tuple[str, str]], where: str, timeout: float, labels=None):
    """fn(response, answer) for each pair -> list of floats, in this (the main) thread: math-verify
    needs it for its own timeouts. A call that raises, runs over `timeout` seconds, or returns
    anything but a finite number stops the run with one line naming the function, `where` (e.g.
    "step 3") and the pair (`labels[i]`, or its row)."""
    name = getattr(fn, "__name__", repr(fn))

    class Late(BaseException):  # not an Exception: a reward function's `except Exception` misses it
        pass

    def late(*_):
        raise Late

    previous = signal.signal(signal.SIGUSR1, late)
    out = []
    try:
        for row, (response, answer) in enumerate(pairs, 1):
            at = f"{where}, {labels[row - 1]}" if labels else f"{where}, row {row}"
            # The signal goes to the main thread itself: a call blocked in sleep() or I/O stops too.
            to_main = (threading.main_thread().ident, signal.SIGUSR1)
            timer = threading.Timer(timeout, signal.pthread_kill, to_main)
            timer.start()
            try:
                value = fn(response, answer)
            except Late:
                why = f"did not return within {timeout:g} s ({at})"
                raise RunError(f"reward function {name} {why}") from None
            except Exception as e:
                why = f"failed ({at}): {type(e).__name__}: {e}"
                raise RunError(f"reward function {name} {why}") from None
            finally:
                timer.cancel()
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                why = f"returned {value!r}, not a finite number ({at})"
                raise RunError(f"reward function {name} {why}")
            out.append(float(value))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return out
