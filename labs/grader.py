"""What every lab's check.py shares: load the student's script, report checks with hints, run a few steps.

    python labs/01-sft-mask/check.py my_sft.py                # function checks, then a short run (a few minutes)
    python labs/01-sft-mask/check.py my_sft.py --no-run       # function checks only (seconds)
    python labs/01-sft-mask/check.py my_sft.py --run-dir runs/all_tokens__1__1795...   # check your lab run instead

A check prints PASS or FAIL with what the script did and a hint; it never prints the code of the answer. The
grader exits 1 if any check failed. The run part starts only when every function check passed.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckFailed(Exception):
    """A check's condition was false; the message says what the script did (never what it should have done)."""


def expect(condition: bool, observed: str) -> None:
    if not condition:
        raise CheckFailed(observed)


def close(a, b, tol: float = 1e-5) -> bool:
    """Numbers, or nested lists/tensors of numbers, equal within tol."""
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
    return abs(float(a) - float(b)) <= tol


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
        parser.add_argument(
            "--no-run", action="store_true", help="function checks only, no training run"
        )
        parser.add_argument(
            "--run-dir",
            action="append",
            default=[],
            help="check the metrics of this finished run of your script instead of starting one (repeat the flag "
            "for a lab that compares runs; each is matched by its settings)",
        )
        self.opts = parser.parse_args()
        self.lab, self.parent, self.failed, self.passed, self.defaults = lab, parent, [], 0, {}
        self.script = os.path.abspath(self.opts.script)
        if not os.path.isfile(self.script):
            sys.exit(f"error: no such script: {self.opts.script}")
        print(f"lab {lab}: checking {self.opts.script}")

    def load(self):
        """Import the student's script as a module (the scripts have no side effects on import)."""
        for path in (REPO, os.path.dirname(self.script)):
            if path not in sys.path:
                sys.path.insert(0, path)
        name = "student_" + os.path.basename(self.script)[: -len(".py")]
        spec = importlib.util.spec_from_file_location(name, self.script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            print(traceback.format_exc(limit=-1).rstrip())
            sys.exit(
                f"FAIL  importing {self.opts.script} raised an error (above); fix it and run the grader again"
            )
        if dataclasses.is_dataclass(getattr(module, "Args", None)):
            self.defaults = {f.name: f.default for f in dataclasses.fields(module.Args)}
        return module

    def check(self, name: str, hint: str):
        """`with grader.check("what is checked", hint="..."):` runs the block; any error there fails the check."""
        return _Check(self, name, hint)

    def needs_run(self) -> bool:
        """True when the run part should go on: every function check passed and --no-run was not given."""
        if self.failed:
            print(f"\n{len(self.failed)} function check(s) failed; fix them before the run part.")
            return False
        return not self.opts.no_run

    def run(self, flags: list[str], required: dict, parent_ok: bool = False) -> list[dict]:
        """The metric rows (metrics.jsonl) of a short run of the script with `flags`, or of a --run-dir made with
        the `required` settings ({arg name: value}), so that its numbers mean what the check tests. The run
        dir must come from the student's script, or (parent_ok) from the parent script at the same settings."""
        if self.opts.run_dir:
            scripts = {os.path.basename(self.script)} | ({self.parent} if parent_ok else set())
            for run_dir in self.opts.run_dir:
                with open(os.path.join(run_dir, "config.json")) as f:
                    config = json.load(f)
                args = config["args"]
                if os.path.basename(config["script"]) not in scripts:
                    continue
                # A run of the parent script lacks the new flags: it counts as the variant at their defaults.
                if all(args.get(k, self.defaults.get(k)) == v for k, v in required.items()):
                    print(f"\nrun dir: {run_dir}")
                    return _read_rows(run_dir)
            sys.exit(
                f"FAIL  no --run-dir is a run of {' or '.join(sorted(scripts))} with {required}"
            )
        out = tempfile.mkdtemp(prefix=f"lab{self.lab}_")
        cmd = [sys.executable, self.script, *flags, "--output-dir", out]
        print(
            f"\nrunning: python {os.path.relpath(self.script)} {shlex.join(flags)}  (a few minutes on a laptop)"
        )
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
            sys.exit(
                f"FAIL  the run stopped with exit code {proc.returncode} (its last lines above)"
            )
        (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
        print(f"run dir: {run_dir}")
        return _read_rows(run_dir)

    def finish(self) -> None:
        total = self.passed + len(self.failed)
        if self.failed:
            print(f"\n{len(self.failed)} of {total} checks failed: " + "; ".join(self.failed))
            sys.exit(1)
        print(f"\nall {total} checks passed")


class _Check:
    def __init__(self, grader: Grader, name: str, hint: str):
        self.grader, self.name, self.hint = grader, name, hint

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None:
            self.grader.passed += 1
            print(f"PASS  {self.name}")
            return False
        if kind in (KeyboardInterrupt, SystemExit):
            return False
        observed = str(error) if kind is CheckFailed else f"raised {kind.__name__}: {error}"
        self.grader.failed.append(self.name)
        print(f"FAIL  {self.name}\n      your script: {observed}\n      hint: {self.hint}")
        return True  # go on with the next check


def _read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], key: str) -> list[float]:
    """The values of one metric, in step order (steps that did not log it are left out)."""
    return [r[key] for r in sorted(rows, key=lambda r: r["step"]) if key in r]
