"""common/isolate.py: user code (--reward-fn terms, --tool functions) runs in a process of its
own; its crash is a named error of the call, never the driver's end (the driver here is pytest:
before, os._exit(1) in a reward function ended it). Real processes, no model."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO

from common.errors import InputError
from common.isolate import UserFunction as load_function
from common.rewards import call_reward
from common.tools import call_tool

USER = """
import ctypes, os, time

def pid(response, answer):
    return os.getpid()

def exits(response, answer):
    os._exit(1)

def segfaults(response, answer):
    ctypes.string_at(0)

def aborts(response, answer):
    os.abort()

def divides(response, answer):
    return 1 / 0

class Mine(Exception):
    pass

def mine(response, answer):
    raise Mine("its own type")

def hangs(response, answer):
    time.sleep(3600)

def tool(text):
    \"\"\"Exits on "bye".\"\"\"
    if text == "bye":
        os._exit(3)
    return text.upper()
"""


@pytest.fixture
def user(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER)
    return lambda name: load_function(f"{path}:{name}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "name,how",
    [("exits", "exit status 1"), ("segfaults", "signal SIGSEGV"), ("aborts", "signal SIGABRT")],
)
def test_a_crash_is_the_calls_error_and_the_next_call_gets_a_fresh_process(user, name, how):
    fn = user(name)
    with pytest.raises(SystemExit) as error:
        call_reward(fn, [("4042", "4042")], "step 3", 5.0, ["prompt row 9, sample 2"])
    assert str(error.value.code) == (
        f"error: reward function {name} failed (step 3, prompt row 9, sample 2): Crashed: "
        f"the process running {name} ended ({how})"
    )
    tool = user("tool")
    assert call_tool(tool, "ok", 5.0) == "OK"
    first = tool.child.pid
    assert call_tool(tool, "bye", 5.0) == (
        "error: Crashed: the process running tool ended (exit status 3)"
    )
    assert call_tool(tool, "again", 5.0) == "AGAIN" and tool.child.pid != first
    assert tool.__name__ == "tool" and tool.__doc__.strip() == 'Exits on "bye".'


def test_a_raise_keeps_its_type_and_message(user):
    with pytest.raises(
        SystemExit, match=r"failed \(step 1, row 1\): ZeroDivisionError: division by"
    ):
        call_reward(user("divides"), [("1", "1")], "step 1", 5.0)
    with pytest.raises(SystemExit, match=r"failed \(step 1, row 1\): Mine: its own type$"):
        call_reward(user("mine"), [("1", "1")], "step 1", 5.0)


def test_a_hang_is_cut_at_the_time_limit_and_its_process_killed(user):
    fn = user("hangs")
    started = time.monotonic()
    with pytest.raises(SystemExit, match="reward function hangs did not return within 1 s"):
        call_reward(fn, [("1", "1")], "step 1", 1.0)
    assert time.monotonic() - started < 5 and fn.child is None


def test_it_runs_elsewhere_than_the_driver_and_ships_as_its_path(user):
    fn = user("pid")
    assert fn("a", "b") != os.getpid() and fn("a", "b") == fn.child.pid
    again = pickle.loads(pickle.dumps(fn))  # as Ray sends it to grpo_async.py's reward workers
    assert again.spec == fn.spec and again("a", "b") not in (os.getpid(), fn.child.pid)


def test_bad_specs_stop_in_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "fine.py").write_text("x = 1\n")
    cases = [(f"{tmp_path}/absent.py:f", "expected an existing path/to/file.py:function"),
             (f"{tmp_path}/broken.py:f", "failed to import: ModuleNotFoundError"),
             (f"{tmp_path}/fine.py:f", "has no function 'f'"), (f"{tmp_path}/fine.py:x", "no function 'x'")]  # fmt: skip
    for spec, expected in cases:
        with pytest.raises(InputError, match=expected):
            load_function(spec)


def test_group_signals_are_the_drivers_and_the_process_ends_with_its_driver(tmp_path):
    """SIGTERM and SIGINT sent to the whole group (a scheduler's preemption, Ctrl-C) are the
    driver's to act on: the child ignores them and serves on. A driver killed hard (SIGKILL)
    while its child hangs in a call leaves no child behind (PR_SET_PDEATHSIG)."""
    (tmp_path / "user.py").write_text(USER)
    driver = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {REPO!r})
        from common.isolate import UserFunction as load_function
        pid, hangs = load_function("{tmp_path}/user.py:pid"), load_function("{tmp_path}/user.py:hangs")
        child = pid("", "")
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(child, sig)
        assert pid("", "") == child  # the same process, still serving
        hangs("", "")  # starts its own process, which never returns
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the hanging call's process: the second child
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        if len(children) == 2:
            break
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    assert len(children) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(int(c)) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(int(c)) for c in children)
