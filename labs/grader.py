"""What every lab's check.py shares: load the student's script safely, report checks, run or read a lab run.

    python labs/01-sft-mask/check.py my_sft.py                # function checks, then a short run (minutes)
    python labs/01-sft-mask/check.py my_sft.py --no-run       # function checks only (seconds)
    python labs/01-sft-mask/check.py my_sft.py --run-dir runs/lab01/all_tokens__1__1795...   # grade that run

A check prints PASS or FAIL with what the script did, given which inputs, and a hint; it never prints the
answer's code. Whatever the student's code does, the grader ends with one line that says what went wrong, never
a traceback: the script is first imported in a child process with a time limit (code that runs at import, a
hang, an exit), every check has a time limit, the run part shows its progress and has a time limit too. The
grader exits 1 if anything failed; `--json FILE` also writes the results for labs/grade_all.py.
"""

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import pkgutil
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckFailed(Exception):
    """A check's condition was false; the message says what the script did (never what it should have done)."""


class CheckTimeout(BaseException):
    """A check ran past --check-timeout (a BaseException: a student's `except Exception` cannot swallow it)."""


def expect(condition: bool, observed: str) -> None:
    if not condition:
        raise CheckFailed(observed)


def close(a, b, tol: float = 1e-5) -> bool:
    """Numbers, or nested lists/tuples/tensors of numbers, equal within tol."""
    if hasattr(a, "tolist"):
        a = a.tolist()
    if hasattr(b, "tolist"):
        b = b.tolist()
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(close(x, y, tol) for x, y in zip(a, b))
        )
    try:
        return abs(float(a) - float(b)) <= tol
    except (TypeError, ValueError):  # not a number (e.g. a dict where a list was asked for)
        return False


def rounded(x, digits: int = 4):
    """A tensor or list as a short printable list, for the 'you got ...' part of a message."""
    x = x.tolist() if hasattr(x, "tolist") else x
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return round(float(x), digits) if isinstance(x, float) else x


class Grader:
    def __init__(self, lab: str, parent: str):
        parser = argparse.ArgumentParser(
            description=f"Grader of lab {lab} (your copy of {parent})."
        )
        parser.add_argument("script", help=f"your script, e.g. my_{parent}")
        parser.add_argument("--no-run", action="store_true", help="function checks only, no run")
        parser.add_argument(
            "--run-dir",
            action="extend",
            nargs="+",
            default=[],
            help="grade this finished run of your script (the folder that holds config.json) instead of "
            "starting one; repeat the flag for a lab that compares runs (each is matched by its settings)",
        )
        parser.add_argument(
            "--keep", action="store_true", help="keep the output of the grader's own runs"
        )
        parser.add_argument("--import-timeout", type=float, default=120, metavar="SECONDS")
        parser.add_argument("--check-timeout", type=int, default=60, metavar="SECONDS")  # a loop?
        parser.add_argument("--run-timeout", type=float, default=1800, metavar="SECONDS")
        parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
        self.opts = parser.parse_args()
        self.lab, self.parent, self.defaults = lab, parent, {}
        self.results: list[dict] = []  # {"check", "passed", "observed"} in order
        self.temp_dirs: list[str] = []
        self.name = os.path.basename(self.opts.script)
        self.script = os.path.abspath(self.opts.script)
        self.module_name = "student_" + os.path.splitext(self.name)[0]
        sys.excepthook = self._interrupted
        if not os.path.isfile(self.script):
            self.fatal(f"no such file: {self.opts.script}")
        if not self.script.endswith(".py"):
            self.fatal(f"{self.opts.script}: not a Python script (its name must end in .py)")
        if self.opts.no_run and self.opts.run_dir:
            self.fatal("--no-run and --run-dir together: --no-run skips the run checks, pick one")
        self.problems: list[str] = []  # run folders whose files cannot be read
        self.run_dirs = [r for r in map(self._run_dir, self.opts.run_dir) if r]  # before the import
        print(f"lab {lab}: checking {self.opts.script}", flush=True)

    # ---- the student's script ----

    def load(self):
        """Import the student's script: first in a child process, then here (for the function checks)."""
        for path in (os.path.dirname(self.script), REPO):  # the repo first: its common/ wins
            if path in sys.path:
                sys.path.remove(path)
            sys.path.insert(0, path)
        # The project's own libraries (torch, vLLM, Ray, common/) load once, here: the child below is forked
        # from this process, so the student's import there and here takes a moment, not seconds.
        import common

        with contextlib.redirect_stderr(io.StringIO()):  # the libraries' start-up notices
            for module in pkgutil.iter_modules(common.__path__):
                importlib.import_module(f"common.{module.name}")
        problem = self._import_in_child()
        if problem:
            self.fatal(f"importing {self.name}: {problem}")
        try:  # the child imported it: this fails only for a script that behaves differently here
            module = self._import()
        except BaseException as error:
            self.fatal(f"importing {self.name}: your script {self._describe(error)}")
        if dataclasses.is_dataclass(getattr(module, "Args", None)):
            self.defaults = {f.name: f.default for f in dataclasses.fields(module.Args)}
        return module

    def _import(self):
        spec = importlib.util.spec_from_file_location(self.module_name, self.script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.module_name] = module
        spec.loader.exec_module(module)
        return module

    def _import_in_child(self) -> str:
        """'' when the script imports cleanly in a forked child within --import-timeout, else what happened.
        The child sees the command line `script --help`, so a parser run at import (main(tyro.cli(Args)) outside
        `if __name__ == "__main__":`) exits at once instead of starting a run or reading the grader's flags."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: import, write one line of verdict, exit
            os.close(read)
            os.setsid()  # its own process group: a timeout kills whatever it started
            _die_with(os.getppid())
            quiet = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(quiet, fd)
            sys.argv = [self.script, "--help"]
            try:
                self._import()
                verdict = "ok"
            except BaseException as error:
                verdict = self._describe(error, child=True)
            os.write(write, verdict.encode()[:4000])
            os._exit(0)
        os.close(write)
        timeout = self.opts.import_timeout
        try:
            ready, _, _ = select.select([read], [], [], timeout)
            verdict = os.read(read, 4096).decode(errors="replace") if ready else None
        except KeyboardInterrupt:
            os.killpg(pid, signal.SIGKILL)
            raise
        os.close(read)
        with contextlib.suppress(ProcessLookupError):  # the child, or what its import started
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if verdict is None:
            return (
                f"your script did not finish importing in {timeout:g} s: is there code outside "
                '`if __name__ == "__main__"`?'
            )
        if not verdict:
            return f"the import crashed the Python process ({_status(status)})"
        return "" if verdict == "ok" else f"your script {verdict}"

    def _describe(self, error: BaseException, child: bool = False) -> str:
        """What the student's code did, in one line (after "your script"), with the line it came from."""
        if isinstance(error, SyntaxError) and os.path.abspath(error.filename or "") == self.script:
            return f"has a syntax error at line {error.lineno}: {error.msg}"
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == self.script]
        where = f" at line {frames[-1].lineno} (`{frames[-1].line}`)" if frames else ""
        if isinstance(error, SystemExit):
            return (
                f"exits when it is imported{where}: is there code outside "
                '`if __name__ == "__main__"`?'
            )
        if isinstance(error, KeyboardInterrupt) and not child:
            raise error
        if isinstance(error, AttributeError) and getattr(error, "obj", None) is sys.modules.get(
            self.module_name
        ):
            return f"has no `{error.name}`"
        message = str(error).splitlines()[0] if str(error) else ""
        if not frames and not child:  # raised in the check's own code, by what the script gave it
            return (
                f"gave the check something it cannot read ({type(error).__name__}: {message}): "
                "check the types and shapes the handout asks for"
            )
        return f"raised {type(error).__name__}{where}" + (f": {message}" if message else "")

    def _interrupted(self, kind, error, tb):
        """Ctrl-C outside the run part: one line, the temp folders removed. Other errors: Python's report."""
        if kind is KeyboardInterrupt:
            self._report("interrupted (Ctrl-C)")
            sys.stdout.flush()
            os._exit(130)
        else:
            sys.__excepthook__(kind, error, tb)

    # ---- checks ----

    def check(self, name: str, hint: str):
        """`with grader.check("what is checked", hint="..."):` runs the block; any error there fails the check."""
        return _Check(self, name, hint)

    def needs_run(self) -> bool:
        """True when the run part should go on: every function check passed and --no-run was not given."""
        if self.failed():
            print(f"\n{len(self.failed())} function check(s) failed; fix them before the run part.")
            return False
        return not self.opts.no_run

    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if not r["passed"]]

    # ---- the run part ----

    def run(self, flags: list[str], required: dict, parent_ok: bool = False) -> list[dict]:
        """The metric rows (metrics.jsonl) of a short run of the script with `flags`, or of a --run-dir made with
        the `required` settings ({arg name: value}), so that its numbers mean what the check tests. The run
        dir must come from the student's script, or (parent_ok) from the parent script at the same settings."""
        if self.opts.run_dir:
            return self._given_run(required, parent_ok)
        out = tempfile.mkdtemp(prefix=f"lab{self.lab}_")
        self.temp_dirs.append(out)
        log_path = os.path.join(out, "output.log")
        # the grader reads metrics.jsonl only: no final checkpoint (hundreds of MB)
        cmd = [sys.executable, self.script, *flags, "--no-save-final", "--output-dir", out]
        steps = int(flags[flags.index("--num-steps") + 1])
        print(f"\nrunning: python {self.name} {shlex.join(flags)}  (a few minutes on a laptop)")
        print(f"  its output goes to {log_path}", flush=True)
        # the script may live outside the repository (a submissions folder): common/ is found all the same
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": path}, start_new_session=True,
            )  # fmt: skip
        start, shown, said = time.monotonic(), 0, 0.0
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                elapsed, done = time.monotonic() - start, _last_step(out)
                if done > shown or elapsed - said >= 30:
                    what = f"step {done} of {steps} done" if done else "starting"
                    print(f"  {what}, {elapsed:.0f} s so far", flush=True)
                    shown, said = done, elapsed
                if elapsed > self.opts.run_timeout:
                    _stop(proc)
                    self.fatal(
                        f"the run did not finish in {self.opts.run_timeout:g} s (stopped at step {done} "
                        f"of {steps}); its output: {log_path}",
                        keep=out,
                    )
        except KeyboardInterrupt:
            _stop(proc)
            self.fatal("interrupted (Ctrl-C): the run was stopped", exit_code=130)
        if proc.returncode != 0:
            self.fatal(
                f"the run stopped with exit code {proc.returncode}: {_last_line(log_path)} "
                f"(its whole output: {log_path})",
                keep=out,
            )
        print(f"  finished in {time.monotonic() - start:.0f} s", flush=True)
        runs = [
            os.path.join(out, d) for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))
        ]
        if len(runs) != 1 or not os.path.isfile(os.path.join(runs[0], "metrics.jsonl")):
            self.fatal(
                f"the run ended (exit code 0) without a run folder with metrics.jsonl in {out}: does "
                "your script still call main() and log its metrics?",
                keep=out,
            )
        try:
            return _read_rows(runs[0])
        except ValueError as error:
            self.fatal(f"the run's {error} (in {runs[0]})", keep=out)

    def _run_dir(self, path: str) -> dict | None:
        """A --run-dir as {"path", "config", "rows"}; a FAIL line now if it is no run folder at all, None
        (and a note for later) if its files cannot be read."""
        if not os.path.isdir(path):
            near = _runs_near(path)
            what = "a file, not a folder" if os.path.exists(path) else "no such folder"
            self.fatal(
                f"--run-dir {path}: {what}"
                + (f"; the runs next to it: {', '.join(near)}" if near else "")
            )
        if not os.path.isfile(os.path.join(path, "config.json")):
            inside = _runs_near(os.path.join(path, ""))
            self.fatal(
                f"--run-dir {path}: not a run folder (it has no config.json)"
                + (f"; the runs inside it: {', '.join(inside)}" if inside else "")
            )
        try:
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            config["args"].get, config["script"]  # noqa: B018 (both must be there)
            return {"path": path, "config": config, "rows": _read_rows(path)}
        except FileNotFoundError:
            self.problems.append(f"{path} has no metrics.jsonl (did the run stop before step 1?)")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            self.problems.append(f"{path}: {error}")
        return None

    def _given_run(self, required: dict, parent_ok: bool) -> list[dict]:
        scripts = {self.name} | ({self.parent} if parent_ok else set())
        seen, matches = [], []
        for run in self.run_dirs:
            args, script = run["config"]["args"], os.path.basename(run["config"]["script"])
            # A run of the parent script lacks the new flags: it counts as the variant at their defaults.
            settings = {k: args.get(k, self.defaults.get(k, "<missing>")) for k in required}
            if script in scripts and settings == required:
                matches.append(run)
            else:
                seen.append(f"{run['path']} is a run of {script} with {_settings(settings)}")
        if matches:  # the newest of the runs made with these settings
            run = max(
                matches, key=lambda r: os.path.getmtime(os.path.join(r["path"], "metrics.jsonl"))
            )
            last, steps = _last_step_of(run["rows"]), run["config"]["args"].get("num_steps")
            older = (
                f"; {len(matches) - 1} older with these settings left out"
                if len(matches) > 1
                else ""
            )
            print(f"\nrun dir: {run['path']}  ({last} of {steps} steps{older})")
            return run["rows"]
        self.fatal(
            f"no --run-dir is a run of {' or '.join(sorted(scripts))} with {_settings(required)}: "
            + "; ".join(seen + self.problems)
        )

    # ---- the end ----

    def fatal(self, message: str, keep: str | None = None, exit_code: int = 1):
        """One FAIL line, the results so far (--json), the temp folders removed (but `keep`), exit."""
        self._report(message, keep)
        sys.exit(exit_code)

    def _report(self, message: str, keep: str | None = None):
        print(f"FAIL  {message}", flush=True)
        self._cleanup(keep)
        self._write_json(error=message)

    def finish(self) -> None:
        self._cleanup()
        self._write_json()
        failed, total = self.failed(), len(self.results)
        if failed:
            print(f"\n{len(failed)} of {total} checks failed: " + "; ".join(failed))
            sys.exit(1)
        print(f"\nall {total} checks passed")

    def _cleanup(self, keep: str | None = None):
        for folder in self.temp_dirs:
            if self.opts.keep or folder == keep:
                print(f"kept: {folder}")
            else:
                shutil.rmtree(folder, ignore_errors=True)

    def _write_json(self, error: str | None = None):
        if self.opts.json:
            result = {"lab": self.lab, "script": self.opts.script, "checks": self.results}
            with open(self.opts.json, "w") as f:
                json.dump({**result, "error": error}, f, indent=1)


class _Check:
    def __init__(self, grader: Grader, name: str, hint: str):
        self.grader, self.name, self.hint = grader, name, hint

    def __enter__(self):
        seconds = self.grader.opts.check_timeout  # a function check takes well under a second

        def too_slow(*_):
            signal.alarm(1)  # again in a second if the script catches it anyway
            raise CheckTimeout(f"did not return within {seconds} s (an endless loop?)")

        signal.signal(signal.SIGALRM, too_slow)
        signal.alarm(seconds)
        return self

    def __exit__(self, kind, error, tb):
        signal.alarm(0)
        if kind is KeyboardInterrupt:
            return False
        if kind is None:
            print(f"PASS  {self.name}", flush=True)
            self.grader.results.append({"check": self.name, "passed": True, "observed": ""})
            return False
        if kind in (CheckFailed, CheckTimeout):
            observed = str(error)
        elif kind is SystemExit:
            observed = f"called sys.exit({error.code!r})"
        else:
            observed = self.grader._describe(error)
        print(
            f"FAIL  {self.name}\n      your script: {observed}\n      hint: {self.hint}", flush=True
        )
        self.grader.results.append({"check": self.name, "passed": False, "observed": observed})
        return True  # go on with the next check


def _die_with(parent: int) -> None:
    """In the import child: end its process group when the grader is gone (killed, or Ctrl-C), so that
    a hung import never outlives it."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _read_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl's rows, each with its step; a last line cut short (a run killed while writing it)
    is left out, any other unreadable line is a ValueError naming it."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = f.read().split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            if number == len(lines):  # no newline after it: cut short
                break
            raise ValueError(f"metrics.jsonl line {number} is not JSON") from None
        if row is not None:
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(f"metrics.jsonl line {number} has no step")
            rows.append(row)
    return rows


def _last_step_of(rows: list[dict]) -> int:
    return max((r.get("step", 0) for r in rows), default=0)


def _last_step(out: str) -> int:
    """The last step a running run has logged (0 before its first)."""
    for name in os.listdir(out):
        if os.path.isfile(os.path.join(out, name, "metrics.jsonl")):
            try:
                return _last_step_of(_read_rows(os.path.join(out, name)))
            except ValueError:  # a line being written
                return 0
    return 0


def _runs_near(path: str) -> list[str]:
    """The run folders in path's folder whose names start like path's last part, else all (at most 5)."""
    folder, start = os.path.split(path)
    start = start.split("...")[0].rstrip("*")
    try:
        names = sorted(os.listdir(folder or "."))
    except OSError:
        return []
    runs = [n for n in names if os.path.isfile(os.path.join(folder, n, "config.json"))]
    return [os.path.join(folder, n) for n in [n for n in runs if n.startswith(start)] or runs][:5]


def _settings(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(no output)"


def _stop(proc: subprocess.Popen) -> None:
    """End a run and everything it started: SIGTERM (the scripts stop cleanly), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def series(rows: list[dict], key: str) -> list[float]:
    """The values of one metric, in step order (steps that did not log it are left out)."""
    return [r[key] for r in sorted(rows, key=lambda r: r["step"]) if key in r]
