"""User code (a --reward-fn term, a --tool function) in a process of its own: its os._exit, its
segfault or abort is that call's named error, never the end of the driver and its checkpoints.
Run as a script, this file is that process: it loads the function and serves calls on a socket."""

import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


class Crashed(RuntimeError): ...  # the process of a user function ended during a call


class NoFunction(Exception): ...  # the file has no function of that name


class Episode(str):
    """grpo_tools.py's episode as the reward terms receive it: a str, the answer (the last turn's
    text; "" when the episode ended on a call, out of turns or room: no answer, 0 from the
    verifier), with the whole episode for a --reward-fn that scores more than the answer:
    .messages (the model's turns and the tools' outputs, in order, as chat messages), .tool_calls,
    .ended_on_call."""

    def __new__(cls, episode: dict):  # run_episodes' episode
        messages, ended_on_call = episode["messages"], episode["ended_on_call"]
        self = super().__new__(cls, "" if ended_on_call else messages[-1]["content"])
        self.messages, self.ended_on_call = messages, ended_on_call
        self.tool_calls = episode["tool_calls"]
        return self

    @classmethod
    def of(cls, text: str):
        """A one-turn episode answering `text` ("": one that ended on a call): the test calls'."""
        turn = {"role": "assistant", "content": text}
        return cls(dict(messages=[turn], ended_on_call=not text, tool_calls=int(not text)))

    def __reduce__(self):  # to the process of a --reward-fn term (light: this module alone)
        return Episode, (dict(vars(self)),)


def load(spec: str):
    """`path/to/file.py:name` -> the function `name` in that file (or NoFunction)."""
    path, _, name = spec.rpartition(":")
    module = f"user_{os.path.basename(path)[:-3]}"
    module_spec = importlib.util.spec_from_file_location(module, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise NoFunction(f"no function {name!r}")
    return getattr(module, name)


class UserFunction:
    """`path.py:name` called in a child python that loads it (the user's module never runs in the
    driver): started here, so bad input stops before anything starts and its start-up is outside
    every call's time limit, and again at the call after a crash. A raise there raises here (its
    type and message kept); a crash raises Crashed naming how it ended; anything raised here while
    waiting (time_limit's Late, Ctrl-C) kills the child."""

    def __init__(self, spec: str):
        from common.errors import InputError

        path, _, name = spec.rpartition(":")
        if not path or not os.path.isfile(path):
            raise InputError(f"{spec!r}: expected an existing path/to/file.py:function")
        self.spec, self.child = f"{os.path.abspath(path)}:{name}", None
        if why := self.start():
            no = why.startswith("no function")
            raise InputError(f"{path} {'has' if no else 'failed to import:'} {why}")

    def start(self) -> str | None:
        """Start the child; when it has loaded the function, its name and docstring are this
        one's; else why it could not (the child ended)."""
        ours, theirs = socket.socketpair()
        me, fd = str(os.getpid()), str(theirs.fileno())
        argv = [sys.executable, os.path.abspath(__file__), self.spec, fd, me]
        self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            ok, loaded = self.conn.recv()
        except EOFError:
            ok, loaded = False, f"its process ended ({self.stop(grace=1.0)})"
        if not ok:
            self.stop()
            return loaded
        self.__name__, self.__doc__ = loaded

    def __reduce__(self):  # to a Ray actor (grpo_async.py's reward workers): the spec alone
        return UserFunction, (self.spec,)

    def __call__(self, *args):
        if self.child is None and (why := self.start()):  # after a crash
            raise Crashed(f"{self.spec} could not be loaded again: {why}")
        try:
            self.conn.send(args)
            ok, value = self.conn.recv()
        except (EOFError, OSError):  # it died: say how, start a fresh one at the next call
            how = self.stop(grace=1.0)
            raise Crashed(f"the process running {self.__name__} ended ({how})") from None
        except BaseException:  # a time limit, an interrupt: the call is abandoned with its process
            self.stop()
            raise
        if ok:
            return value
        raise value if isinstance(value, Exception) else type(value[0], (Exception,), {})(value[1])

    def stop(self, grace: float = 0.0) -> str:
        """End the child (if any), killed if it has not ended within `grace` s; how it ended."""
        child, self.child = self.child, None
        if child is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace)
        child.kill()
        self.conn.close()
        code = child.wait()
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def serve(spec: str, fd: int, parent: int) -> None:
    """The child: load the function (send its name and docstring, or why not), then answer each
    call (args) with (True, value) or (False, the exception: a builtin type as itself, the user's
    own as (name, text)) until the driver closes the socket. It ignores SIGINT and SIGTERM (sent
    to the whole group, they are the driver's to act on) and dies with the thread that started it
    (PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        fn = load(spec)
    except BaseException as e:  # SystemExit too: a module that exits as it loads
        conn.send((False, str(e) if isinstance(e, NoFunction) else f"{type(e).__name__}: {e}"))
        return
    conn.send((True, (fn.__name__, fn.__doc__)))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        except Exception as e:  # arguments that cannot be read here
            conn.send((False, RuntimeError(f"its arguments: {type(e).__name__}: {e}")))
            continue
        try:
            reply = (True, fn(*args))
        except Exception as e:
            builtin = type(e).__module__ == "builtins"
            reply = (False, e if builtin else (type(e).__name__, str(e)))
        try:
            conn.send(reply)
        except Exception as e:  # a value or an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(sys.path[0])  # the repo, as for the driver's script
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
