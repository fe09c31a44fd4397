"""A model's Python run locally, no daemon: a fresh `python -I -u -c code` in its own session, with
no environment or stdin, under rlimits (CPU, memory, file size, files, processes, no core), killed
with its group at the time-out, its output cut as it comes. bubblewrap (else unshare) adds pid and
network namespaces and (bubblewrap) a read-only system, a private /tmp. probe() tries each once."""

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from common.errors import InputError

WRAPPERS = ("bubblewrap", "namespace", None)  # the most isolation first
GUARANTEES = ("time", "memory", "processes", "output", "network", "filesystem")
HOW_TO_GET = "bubblewrap 0.7+ (apt-get install bubblewrap); not root: unprivileged user namespaces"
UNSAFE = {  # why no program may run here (never as the driver's user: it could kill the driver)
    True: "as root each program runs as a uid of its own, and that uid cannot start {python} (a "
    "folder on its path is not readable by others, e.g. /root)",
    False: "neither bubblewrap nor unprivileged user namespaces run a program here",
}
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # no secrets
# Run inside the namespaces: RLIMIT_NPROC set in a new user namespace counts the processes in it,
# not the user's others; root, whom it exempts, becomes a uid of its own (owning, running nothing).
PRELUDE = """import os, resource as r, sys
for name, n in zip(("CPU", "AS", "FSIZE", "NOFILE", "NPROC", "CORE"), map(int, sys.argv[3:])):
    r.setrlimit(getattr(r, "RLIMIT_" + name), (n, n))
if uid := int(sys.argv[1]):
    os.setgroups([]), os.setgid(uid), os.setuid(uid)
os.execv(sys.executable, [sys.executable, "-I", "-u", "-c", sys.argv[2]])"""


def _wrapper(how: str | None, disk_mb: int) -> list[str]:
    """unshare or bwrap: new pid and network namespaces; bwrap's system and Python read-only (the
    folders above 0755 for root's drop), a private /tmp, no --new-session (killpg must reach)."""
    if how != "bubblewrap":
        userns = ["-r"] if os.getuid() else []
        unshare = ["unshare", *userns, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
        return unshare if how else []
    want = {
        *"/usr /bin /sbin /lib /lib32 /lib64 /etc".split(),
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    keep = sorted(p for p in want if not any(p.startswith(q + "/") for q in want))
    above = sorted({p[:i] for p in keep for i in range(1, len(p)) if p[i] == "/"} - {"/tmp"})
    root = "--cap-add CAP_SETUID --cap-add CAP_SETGID".split()  # root's program drops to a uid
    user = ["--unshare-user"] if os.getuid() else root
    # the private /tmp first: a Python under /tmp (a CI clone's) is bound on it, not hidden by it
    return [
        *"bwrap --unshare-pid --unshare-net --unshare-ipc --unshare-uts --die-with-parent".split(),
        *user,
        *["--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", "/tmp"],
        *[a for p in above for a in ("--perms", "0755", "--dir", p)],
        *[a for p in keep for a in ("--ro-bind-try", p, p)],
        *"--proc /proc --dev /dev --chdir /tmp".split(),
    ]


@functools.cache
def probe() -> dict[str, str | None]:
    """{guarantee: its mechanism here, or None where this machine lacks it}: the first layering that
    runs a program here, never as the driver's user: as root, as a uid of its own in each; else in
    a user namespace (without one its programs could signal the driver and outlive the call). When
    none does, "unsafe" says why; when bubblewrap is installed but failed, "bubblewrap" its line."""
    root, tried = os.getuid() == 0, {}
    for how in WRAPPERS if root else WRAPPERS[:2]:
        tried[how] = _run("print(1)", how, root, 5, 256, 300, 8)
        if tried[how] == "1\n":
            break
    else:
        how = False  # nothing runs a program safely here
    held = {
        "time": "pid namespace + kill" if how else "session + kill",
        "memory": "rlimit",
        "processes": "rlimit, own uid" if root else "rlimit in user namespace",
        "output": "capped pipe",
        "network": how or None,
        "filesystem": "bubblewrap" if how == "bubblewrap" else None,
    }
    if how is False:
        held["unsafe"] = UNSAFE[root].format(python=sys.executable)
    if shutil.which("bwrap") and tried.get("bubblewrap", "1\n") != "1\n":
        held["bubblewrap"] = tried["bubblewrap"].strip().splitlines()[0]  # in its own words
    return held


def describe(held: dict) -> str:
    """The start-up line: each guarantee ✓ (its mechanism) or ✗, then how to get those missing."""
    marks = " ".join(f"{g} ✓ ({held[g]})" if held[g] else f"{g} ✗" for g in GUARANTEES)
    lack, failed = [g for g in GUARANTEES if not held[g]], held.get("bubblewrap")
    how = f"bubblewrap is installed but failed here: {failed}" if failed else HOW_TO_GET
    return f"sandbox: {marks}" + (f" (for {', '.join(lack)}: {how})" if lack else "")


def check(mode: str) -> str:
    """describe(probe()); InputError where no program may run, or (mode "strict") where a
    guarantee is missing."""
    held = probe()
    if unsafe := held.get("unsafe"):
        raise InputError(f"--tool python: no safe sandbox here: {unsafe}; {HOW_TO_GET}")
    if mode == "strict" and (lack := [g for g in GUARANTEES if not held[g]]):
        raise InputError(f"--sandbox strict: this machine lacks {', '.join(lack)}: {HOW_TO_GET}")
    return describe(held)


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output: int = 2000,
    max_procs: int = 16,
) -> str:
    """Its stdout and stderr, merged and cut at max_output characters, then a line for a time-out,
    a kill or a non-zero exit status. Never raises; nothing of it outlives the call."""
    held = probe()  # its network mechanism is the wrapper; root's program: a uid of its own
    if held.get("unsafe"):
        return f"error: no safe sandbox here: {held['unsafe']}"
    return _run(code, held["network"], os.getuid() == 0, timeout, memory_mb, max_output, max_procs)


def _run(code, how, drop, timeout, memory_mb, max_output, max_procs) -> str:
    uid = 1 << 24 | int.from_bytes(os.urandom(3)) if drop else 0  # random: one per run
    limits = (int(timeout) + 2, memory_mb << 20, 16 << 20, 64, max_procs, 0)
    argv = [*_wrapper(how, memory_mb), sys.executable, "-I", "-c", PRELUDE, str(uid), code]
    out, cut, rc = bytearray(), False, None
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as tmp:
        os.chown(tmp, uid or -1, uid or -1)  # the cwd, for root's drop (bwrap's is a tmpfs)
        try:
            p = subprocess.Popen(
                [*argv, *map(str, limits)],
                cwd=tmp,
                env=ENV,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError) as e:  # a wrapper gone; too long, a NUL, a lone surrogate
            return f"error: could not start python ({getattr(e, 'strerror', None) or e})"
        deadline, ready = time.monotonic() + timeout, select.poll()  # select(): fds < 1024 only
        ready.register(fd := p.stdout.fileno(), select.POLLIN)
        try:
            while not cut and (left := deadline - time.monotonic()) > 0:
                chunk = os.read(fd, 1 << 16) if ready.poll(min(left, 0.01) * 1000) else None
                if chunk == b"":  # closed by all: poll() only waits from now on
                    ready.unregister(fd)
                out += chunk or b""
                cut = len(out) > 4 * max_output + 64  # a flood stops here, not in our memory
                if not chunk and (rc := p.poll()) is not None:  # ended; the pipe quiet or closed
                    break
        finally:
            _end(p.pid, uid or -1)
            p.wait(), p.stdout.close()
    text = out.decode(errors="replace")
    if cut or len(text) > max_output:
        text = f"{text[:max_output]}\n... [output cut at {max_output} characters]"
    sig = -rc if rc and rc < 0 else rc - 128 if how == "bubblewrap" and 128 < (rc or 0) < 160 else 0
    note = ""
    if rc is None and not cut:
        note = f"error: timed out after {timeout:g} s"
    elif sig and not cut:
        note = f"error: killed by signal {sig} ({signal.strsignal(sig)})"
    elif rc and not cut:
        note = f"exit status {rc}"
    return text + ("\n" if note and text and not text.endswith("\n") else "") + note


def _end(pgid: int, uid: int) -> None:
    """SIGKILL the group (its pid namespace goes with its init) and uid's, till none is alive."""
    for _ in range(500):
        left = [-pgid]  # the group at once, then each process seen
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, ValueError):  # ended meanwhile
                with open(f"/proc/{pid}/stat") as f:
                    state, _, group = f.read().rpartition(")")[2].split()[:3]
                if state != "Z" and (int(group) == pgid or os.stat(f"/proc/{pid}").st_uid == uid):
                    left.append(int(pid))
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if len(left) == 1:
            return
        time.sleep(0.01)
