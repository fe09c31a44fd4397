"""How a run's processes end whatever ends the driver (even SIGKILL): after the driver a watchdog
ends those here seen below it (a private Ray's) or marked POSTTRAIN_RUN (its actors, no other
job's); end_ray() at exit awaits them, then after_end()'s work."""

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid

MARKER = "POSTTRAIN_RUN"
_AFTER_END: list = []  # callables to run once every process of the run has ended
_WATCHDOG: list[int] = []
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the watchdog runs from there


def mark_run() -> str:
    """The run's marker (KEY=value, for the actors' runtime_env); starts its watchdog (unmarked)."""
    if os.environ.get(MARKER, "").startswith(f"{os.getpid()}-"):  # marked already (Ray restarted)
        return f"{MARKER}={os.environ[MARKER]}"
    marker = f"{MARKER}={os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    os.environ[MARKER] = marker.split("=", 1)[1]
    if os.path.isdir("/proc"):
        argv = [sys.executable, "-m", "common.lifetime", str(os.getpid()), marker]
        quiet = subprocess.DEVNULL
        _WATCHDOG.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=quiet,
                stdout=quiet,
                stderr=quiet,
                start_new_session=True,
            ).pid
        )
    return marker


def run_processes(marker: str = "", seen: dict | None = None) -> list[int]:
    """The run's live processes here but this one and its watchdog: below it (a private Ray's) or
    `seen` (the watchdog's record: a Ray rename can blank /proc environ), or marked (its actors)."""
    live, marker = _live(), (marker or f"{MARKER}={os.environ.get(MARKER)}").encode()
    found = {int(p) for p in _proc("environ", lambda env: marker in env.split(b"\0"))}
    roots = [p for p, start in (seen or {}).items() if live.get(p, (0, b""))[1] == start]
    found = found & set(live) | set(_below([os.getpid(), *roots], live))
    return sorted(found - {os.getpid(), *_WATCHDOG})


def _live() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, start time) of every process that has not ended (Linux)."""
    stats = {int(p): s.rsplit(b")", 1)[1].split() for p, s in _proc("stat", bool).items()}
    return {p: (int(s[1]), s[19]) for p, s in stats.items() if s[0] not in b"ZX"}


def _below(roots: list[int], live: dict) -> dict[int, bytes]:
    """The processes below `roots`, roots included: pid -> start time (a reused pid is another)."""
    found, todo = {}, [p for p in roots if p in live]
    while todo:
        pid = todo.pop()
        found[pid] = live[pid][1]
        todo += [p for p, (parent, _) in live.items() if parent == pid and p not in found]
    return found


def other_ray_processes() -> list[str]:
    """The Ray worker processes on this machine as "ray::Engine (pid 123)": another run's, say."""
    found = _proc("cmdline", lambda cmd: cmd.startswith(b"ray::"))
    names = {pid: cmd.split(b"\0")[0].decode(errors="replace") for pid, cmd in found.items()}
    return [f"{name} (pid {pid})" for pid, name in names.items()]


def _proc(file: str, keep) -> dict[str, bytes]:
    """{pid: /proc/<pid>/<file>} of the processes whose file `keep` accepts (Linux; else none)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/{file}", "rb") as f:
            found.update([(pid, text)] if keep(text := f.read()) else [])
    return found


def stop_processes(grace: float = 1.0, marker: str = "", seen: dict | None = None) -> None:
    """SIGTERM the run's processes on this node, SIGKILL those left after `grace` s, until none."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        deadline = time.monotonic() + wait
        while (pids := run_processes(marker, seen)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            time.sleep(0.1)


def after_end(fn) -> None:
    """Run `fn` once the run's processes have ended (remove what a trainer may still write into)."""
    if (ray := sys.modules.get("ray")) and ray.is_initialized():
        _AFTER_END.append(fn)
    else:
        fn()


def end_ray(shutdown: bool = True) -> None:
    """At exit: stop Ray, wait for the run's processes to end (SIGKILL after 10 s), run what waited
    for that (after_end). Without `shutdown` (a signal): stop the processes at once (1 s grace)."""
    if shutdown and (ray := sys.modules.get("ray")) and ray.is_initialized():
        ray.shutdown()
    deadline = time.monotonic() + (10 if shutdown else 0)
    while run_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    stop_processes(grace=0 if shutdown else 1.0)
    while _AFTER_END:
        _AFTER_END.pop(0)()


def stop_now(line: str) -> None:
    """A signal's end: the run's processes stopped (not by Ray's shutdown: its C code resets
    SIGTERM, and a second signal must find the handler), the `line`, and exit status 1."""
    end_ray(shutdown="RAY_ADDRESS" in os.environ)
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # not Ray's exit hook: its instance is gone, its shutdown would wait on it


if __name__ == "__main__":  # the watchdog: wait for the driver's end, then end the run's processes
    driver, marker, seen = int(sys.argv[1]), sys.argv[2], {}
    try:
        pidfd = os.pidfd_open(driver)
        ended = lambda: select.select([pidfd], [], [], 0.5)[0]  # noqa: E731
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3)
        ended = lambda: time.sleep(0.5) or not os.path.exists(f"/proc/{driver}")  # noqa: E731
    while not ended():  # every process ever below the driver: after its end they hang below init
        seen.update(_below([driver], _live()))
    stop_processes(grace=2.0, marker=marker, seen=seen)
