"""common/sandbox.py: each guarantee against code that breaks it (skipped, with the reason, where
probe() says this machine lacks its mechanism), the start-up line, no raise whatever the code."""

import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from conftest import REPO

from common import sandbox
from common.errors import InputError

# Time limits of 1 s and more: alone on the machine.
pytestmark = pytest.mark.serial

HELD = sandbox.probe()
FORKS = """import os, time
n = 0
for _ in range(200):  # at most 200, bounded or not
    try:
        if os.fork() == 0:
            time.sleep(60)
        n += 1
    except OSError:
        break
print("forked", n)"""
ESCAPE = """import os, time
if os.fork() == 0:
    os.setsid()  # out of the process group: killpg misses it
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("escaped")"""


@pytest.fixture(autouse=True)
def a_safe_layering(request):
    """Where no layering runs a program as anyone but the driver's user (root without bubblewrap,
    its Python in a folder others cannot read, e.g. /root), run_python refuses every program: the
    tests that run one skip, saying why; the refusal itself is tested (the last test)."""
    if HELD.get("unsafe") and not request.node.name.startswith("test_no_safe_layering"):
        pytest.skip(f"no safe sandbox here: {HELD['unsafe']}; {sandbox.HOW_TO_GET}")


def needs(guarantee: str) -> None:
    if not HELD[guarantee]:
        pytest.skip(f"no {guarantee} guarantee here: {sandbox.HOW_TO_GET}")


def marked(code: str):
    """The code with a fresh mark in its command line, and a function listing the live processes
    (seen from the host, in any namespace) that carry it."""
    mark = uuid.uuid4().hex

    def alive() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:  # a zombie's is empty
                    found += [int(pid)] if mark.encode() in f.read() else []
            except OSError:
                pass
        return found

    return f"{code}\n# {mark}", alive


@pytest.mark.parametrize(
    "code",
    [
        "while True: pass",
        "import time; time.sleep(60)",
        "import os, time; os.fork(); time.sleep(60)",
    ],
)
def test_time(code):
    needs("time")
    code, alive = marked(code)
    start = time.monotonic()
    out = sandbox.run_python(code, timeout=1)
    assert time.monotonic() - start < 1 + 1.5
    assert out == "error: timed out after 1 s"
    assert not alive(), "a process of the program outlived the call"


def test_processes():
    needs("processes")
    code, alive = marked(FORKS)
    out = sandbox.run_python(code, timeout=3, max_procs=8)
    assert out.startswith("forked ") and int(out.split()[1]) < 8, out
    assert not alive(), "a forked process outlived the call"
    code, alive = marked(ESCAPE)  # the pid namespace or root's own uid ends it
    assert sandbox.run_python(code) == "escaped\n"
    assert not alive(), "a process that left the group outlived the call"
    assert sandbox.run_python("print(6 * 7)") == "42\n"  # the machine is still usable


def test_memory():
    needs("memory")
    out = sandbox.run_python("x = bytearray(10 * 2**30)", memory_mb=256)
    assert "MemoryError" in out and out.endswith("exit status 1"), out
    limit = "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)"
    assert sandbox.run_python(limit, memory_mb=256) == "256\n"  # the program's own, not a wrapper's
    assert sandbox.run_python("print(len(bytearray(64 * 2**20)))", memory_mb=256) == f"{64 << 20}\n"


@pytest.mark.parametrize("code", ['print("x" * 10_000_000)', 'while True: print("x" * 1000)'])
def test_output(code):
    needs("output")
    start = time.monotonic()
    out = sandbox.run_python(code, max_output=100, timeout=5)
    assert time.monotonic() - start < 3, "a flood is cut when it arrives, not at the time-out"
    assert out == "x" * 100 + "\n... [output cut at 100 characters]"


def test_output_merged_in_order():
    code = "import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')"
    assert sandbox.run_python(code) == "a\nb\nc\n"


def test_network():
    needs("network")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        code = f"""import socket
try:
    socket.create_connection(("127.0.0.1", {port}), 2)
    print("connected")
except OSError as e:
    print("failed", e.errno)"""
        out = sandbox.run_python(code)
        assert out.startswith("failed"), out
        with pytest.raises(TimeoutError):
            listener.accept()
        socket.create_connection(("127.0.0.1", port), 2).close()  # the host's own: it works
        listener.accept()[0].close()


def test_filesystem(tmp_path):
    needs("filesystem")
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    shared = tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(shared, 0o777)  # writable by any uid on the host: only a mount keeps it out
    outside = [tmp_path / name, os.path.join(sys.prefix, name), os.path.join(REPO, name)]
    outside += [os.path.join(os.path.expanduser("~"), name), os.path.join(shared, name)]
    outside += ["/dev/shm/" + name] if os.path.isdir("/dev/shm") else []
    code = f"""for path in {[str(path) for path in outside]!r}:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("refused", type(e).__name__)
open("/tmp/{name}", "w").write("private")  # its own /tmp, not the host's
open("inside.txt", "w").write("ok")
print(open("inside.txt").read())"""
    outside.append(f"/tmp/{name}")
    try:
        out = sandbox.run_python(code)
        assert "wrote" not in out and out.count("refused") == len(outside) - 1, out
        assert out.endswith("ok\n"), out  # its own folder is writable
        assert not [path for path in outside if os.path.exists(path)]
    finally:
        for path in outside:
            if os.path.exists(path):
                os.remove(path)
        os.rmdir(shared)
    assert sandbox.run_python("import os; print(os.listdir('.'))") == "[]\n"  # a fresh folder


@pytest.mark.parametrize("how", sandbox.WRAPPERS)
def test_each_layering(how):
    """Each wrapper that runs a program here, the fallbacks too (run as probe() would: as root,
    as a uid of its own; else in a user namespace): a time-out, a fork loop and a process out of
    the group leave nothing behind."""
    root = os.getuid() == 0
    if not root and how is None:
        pytest.skip("no wrapper is not a layering for a user other than root: refused (probe())")
    run = lambda code, t=5: sandbox._run(code, how, root, t, 256, 200, 8)  # noqa: E731
    if run("print(6 * 7)") != "42\n":
        pytest.skip(f"{how or 'no wrapper'} runs no program here (as probe() would run it)")
    code, alive = marked("import os, time; os.fork(); time.sleep(60)")
    assert run(code, 0.5) == "error: timed out after 0.5 s" and not alive()
    code, alive = marked(FORKS)
    out = run(code)
    assert not alive() and int(out.split()[1]) < 8, out
    code, alive = marked(ESCAPE)
    assert run(code) == "escaped\n" and not alive()


def test_describe_and_check(monkeypatch):
    line = sandbox.check("auto")
    assert line == sandbox.describe(HELD) and line.startswith("sandbox: ")
    assert all(f"{g} ✓" in line or f"{g} ✗" in line for g in sandbox.GUARANTEES)
    if all(HELD.values()):
        assert sandbox.check("strict") == line
    else:
        with pytest.raises(InputError):
            sandbox.check("strict")
    every = dict.fromkeys(sandbox.GUARANTEES, "a mechanism")
    monkeypatch.setattr(sandbox, "probe", lambda: every)
    assert sandbox.check("strict") == sandbox.describe(every) and "✗" not in sandbox.check("auto")
    for missing in sandbox.GUARANTEES:
        monkeypatch.setattr(sandbox, "probe", lambda m=missing: {**every, m: None})
        with pytest.raises(InputError, match=f"^error: --sandbox strict: .*lacks {missing}: "):
            sandbox.check("strict")
        assert f"{missing} ✗" in sandbox.check("auto")
        assert sandbox.check("auto").endswith(f"(for {missing}: {sandbox.HOW_TO_GET})")
    monkeypatch.setattr(sandbox, "probe", lambda: {**every, "filesystem": None, "network": None})
    with pytest.raises(InputError, match="lacks network, filesystem: .*apt-get install bubblewrap"):
        sandbox.check("strict")


@pytest.mark.parametrize(
    "code, out",
    [
        ("print(6 * 7)", "42\n"),
        ("import sys; sys.exit(3)", "exit status 3"),
        ("print('hi', end=''); raise SystemExit(2)", "hi\nexit status 2"),
        ("import os; os.close(1); os.close(2)", ""),
        ("import os; os.kill(os.getpid(), 9)", "error: killed by signal 9 (Killed)"),
    ],
)
def test_exact_output(code, out):
    if "kill" in code and HELD["network"] == "namespace":
        pytest.skip("under unshare the program is its pid namespace's init: its own signals miss")
    assert sandbox.run_python(code) == out


@pytest.mark.parametrize(
    "code, part",
    [
        ("def (", "SyntaxError"),
        ("1 / 0", "ZeroDivisionError"),
        ("import sys; sys.stdout.close(); print(1)", "ValueError"),
        ("x = 1  # " + "x" * 200_000, "error: could not start python"),  # over an argument's size
        ("print(1)\0", "error: could not start python (embedded null byte)"),
        ("print('\ud800')", "error: could not start python ('utf-8' codec can't encode"),
    ],
)
def test_never_raises(code, part):
    assert part in sandbox.run_python(code)


def test_threads_and_no_folder_left():
    before = set(os.listdir(tempfile.gettempdir()))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(sandbox.run_python, [f"print({i})" for i in range(8)]))
    assert outs == [f"{i}\n" for i in range(8)]
    assert not [d for d in set(os.listdir(tempfile.gettempdir())) - before if "sandbox-" in d]


ATTACKS = """import os
pid, results = {pid}, []
def attempt(name, act):
    try:
        act()
        results.append(name + " DONE")
    except Exception as e:
        results.append(name + " " + type(e).__name__)
attempt("environ", lambda: open(f"/proc/{{pid}}/environ", "rb").read())
attempt("memory", lambda: open(f"/proc/{{pid}}/mem", "rb"))
attempt("signal", lambda: os.kill(pid, 0))
attempt("netns", lambda: open(f"/proc/{{pid}}/ns/net"))
attempt("shadow", lambda: open("/etc/shadow").read())
attempt("root", lambda: open("/root/{mark}", "w").write("x"))
attempt("project", lambda: open("{repo}/{mark}", "w").write("x"))
print(*results, sep="\\n")"""


@pytest.mark.parametrize("how", sandbox.WRAPPERS)
def test_attacks_on_the_driver_fail_in_every_layering(how):
    """What a hostile program tried as root (as the layering ran it, as real root, before): read
    the driver's environment and memory, signal it, enter its network namespace, read /etc/shadow,
    write into /root and the project. In every layering this machine offers (as probe() would run
    it: as root, as a uid of its own; else in a user namespace), each fails."""
    root = os.getuid() == 0
    if not root and how is None:
        pytest.skip("no wrapper is not a layering for a user other than root: refused (probe())")
    if sandbox._run("print(1)", how, root, 5, 256, 300, 8) != "1\n":
        pytest.skip(f"{how or 'no wrapper'} runs no program here (as probe() would run it)")
    mark = f"sandbox-attack-{uuid.uuid4().hex}"
    code = ATTACKS.format(pid=os.getpid(), mark=mark, repo=REPO)
    out = sandbox._run(code, how, root, 10, 256, 2000, 8)
    lines = out.splitlines()
    assert len(lines) == 7 and not [line for line in lines if "DONE" in line], out
    assert not os.path.exists(f"/root/{mark}") and not os.path.exists(f"{REPO}/{mark}")


def test_bubblewrap_is_used_with_a_python_under_tmp(tmp_path):
    """A CI clone (and its environment) under /tmp: bubblewrap's private /tmp was mounted over the
    interpreter, the probe fell back and the line still said "apt-get install bubblewrap". Now the
    interpreter is bound on top of the private /tmp; a bubblewrap that fails prints its own error."""
    if HELD["filesystem"] != "bubblewrap":
        pytest.skip(f"no bubblewrap here: {HELD.get('bubblewrap') or sandbox.HOW_TO_GET}")
    parent = tempfile.mkdtemp(dir="/tmp", prefix="sandbox-venv-")  # 0700, as a CI clone's
    env = os.path.join(parent, "venv")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
        code = (f"import sys; sys.path.insert(0, {REPO!r}); from common import sandbox; "
                "print(sandbox.probe()['filesystem'], sandbox.run_python('print(6 * 7)'), end='')")  # fmt: skip
        out = subprocess.run([f"{env}/bin/python", "-c", code], capture_output=True, text=True)
        assert out.stdout == "bubblewrap 42\n", out.stdout + out.stderr
    finally:
        shutil.rmtree(parent)


def test_no_safe_layering_refuses_to_start_and_says_why(monkeypatch):
    """Where no layering runs a program as anyone but the driver's user, --tool python does not
    start (it could kill the driver, outlive the call, read its secrets); run_python says so
    without raising. An installed bubblewrap that fails is named with its own error."""
    failed = "bwrap: execvp /tmp/x/bin/python: No such file or directory\nexit status 1"
    as_itself = lambda code, how, drop, *limits: failed if drop else "1\n"  # noqa: E731
    monkeypatch.setattr(sandbox, "_run", as_itself)  # runs programs as the driver's user only
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/usr/bin/bwrap")
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 0)  # root: before, it ran them as root
    sandbox.probe.cache_clear()
    try:
        held = sandbox.probe()
        assert held["unsafe"] and held["bubblewrap"] == failed.splitlines()[0]
        for mode in ("auto", "strict"):
            with pytest.raises(InputError, match="^error: --tool python: no safe sandbox here: "):
                sandbox.check(mode)
        assert sandbox.run_python("print(1)").startswith("error: no safe sandbox here: ")
        line = sandbox.describe({**held, "unsafe": None})
        assert line.endswith(
            "bubblewrap is installed but failed here: " + failed.splitlines()[0] + ")"
        )
    finally:
        sandbox.probe.cache_clear()
