"""The labs' graders on broken student code: every failure class ends in one line that says what
happened (never a traceback or a tool's box), the run part reports progress, stops a run that hangs
and cleans up after itself, and labs/grade_all.py grades a folder of submissions into one table."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import needs_keys

# A hang stopped after its time limit: alone on the machine.
pytestmark = pytest.mark.serial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABS = os.path.join(REPO, "labs")
GUARD = 'if __name__ == "__main__":\n    main(parse_args(Args))\n'
OUTSIDE = 'is there code outside `if __name__ == "__main__"`?'

# Runs a lab's check.py once per argument list, in this one process (the libraries load once), and
# prints one JSON line: [exit code, everything printed] per run.
GRADE_PROGRAM = """
import contextlib, io, json, runpy, sys
check, *runs = sys.argv[1:]
results = []
for argv in runs:
    out, code = io.StringIO(), 0
    sys.argv = [check, *json.loads(argv)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(check, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


def grade_in_one_process(lab: str, runs: list[list[str]]) -> list[tuple[int, str]]:
    check = os.path.join(LABS, lab, "check.py")
    args = [json.dumps(r) for r in runs]
    proc = subprocess.run(
        [sys.executable, "-c", GRADE_PROGRAM, check, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def variant(parent: str, path, old: str = "", new: str = "", guard: bool = True) -> str:
    """A copy of a parent script with `old` replaced by `new` (once), and its __main__ guard kept or
    dropped (main called at the top level)."""
    with open(os.path.join(REPO, parent)) as f:
        text = f.read()
    assert text.endswith(GUARD)
    text = text[: -len(GUARD)]
    if old:
        assert old in text, old
        text = text.replace(old, new, 1)
    text += GUARD if guard else "main(parse_args(Args))\n"
    path.write_text(text)
    return str(path)


def line_of(path: str, code: str) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip() == code)


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


@needs_keys
def test_broken_scripts_end_in_one_line_each(tmp_path):
    """Lab 03's grader on one script per failure class: no __main__ guard, a hang at import, an
    error and a syntax error at import, a check that never returns, a missing function, a run dir
    that is wrong in four ways; and the unchanged parent fails exactly the two checks it should."""
    before_args = "@dataclass\nclass Args("
    no_guard = variant("grpo.py", tmp_path / "no_guard.py", guard=False)
    hang = variant(
        "grpo.py",
        tmp_path / "hang.py",
        before_args,
        "import time\ntime.sleep(600)\n\n\n" + before_args,
    )
    name_error = variant(
        "grpo.py",
        tmp_path / "name_error.py",
        before_args,
        "RATE = undefined * 2\n\n\n" + before_args,
    )
    syntax = variant(
        "grpo.py", tmp_path / "syntax.py", before_args, "def broken(:\n    pass\n\n\n" + before_args
    )
    loop = variant(
        "grpo.py",
        tmp_path / "loop.py",
        "def compute_advantages(",
        "def compute_advantages(*args):\n    while True:\n        try:\n            pass\n"
        "        except Exception:\n            pass\n\n\ndef old_advantages(",
    )
    missing = variant(
        "grpo.py", tmp_path / "missing.py", "def compute_advantages(", "def advantages("
    )
    returns_none = variant(
        "grpo.py",
        tmp_path / "returns_none.py",
        "def compute_advantages(",
        "def compute_advantages(*args):\n    return None\n\n\ndef old_advantages(",
    )
    (tmp_path / "no_suffix").write_text("x = 1\n")
    runs = tmp_path / "runs" / "lab03"
    for name, script, minibatches in (
        ("grpo__1__17", "grpo.py", 2),
        ("dr_grpo__1__18", "my.py", 1),
    ):
        (runs / name).mkdir(parents=True)
        config = {"script": script, "args": {"num_minibatches": minibatches, "num_steps": 6}}
        (runs / name / "config.json").write_text(json.dumps(config))
        (runs / name / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.4}\n')
    (tmp_path / "runs" / "stopped").mkdir()
    (tmp_path / "runs" / "stopped" / "config.json").write_text(json.dumps(config))
    solved = tmp_path / "solved"
    solved.mkdir()
    (solved / "grpo.py").write_text(open(os.path.join(REPO, "grpo.py")).read())
    subprocess.run(
        ["git", "apply", os.path.join(LABS, "03-dr-grpo", "solution.diff")], cwd=solved, check=True
    )
    os.rename(solved / "grpo.py", solved / "my.py")
    results = grade_in_one_process(
        "03-dr-grpo",
        [
            [no_guard],
            [hang, "--import-timeout", "3"],
            [name_error],
            [syntax],
            [loop, "--no-run", "--check-timeout", "1"],
            [missing, "--no-run"],
            [os.path.join(REPO, "grpo.py"), "--no-run"],
            [str(solved / "my.py"), "--run-dir", f"{runs}/dr_grpo__..."],
            [str(solved / "my.py"), "--run-dir", str(runs)],
            [str(solved / "my.py"), "--run-dir", str(tmp_path / "runs" / "stopped")],
            [str(solved / "my.py"), "--run-dir", str(runs / "grpo__1__17")],
            [returns_none, "--no-run"],
            [str(tmp_path / "no_suffix"), "--no-run"],
            [str(solved / "my.py"), "--run-dir", str(runs / "grpo__1__17" / "config.json")],
        ],
    )
    for code, out in results:
        assert code == 1 and "Traceback" not in out and "╭" not in out, out
    main_line = line_of(no_guard, "main(parse_args(Args))")
    error_line = line_of(name_error, "RATE = undefined * 2")
    syntax_line = line_of(syntax, "def broken(:")
    assert [last_line(out) for _, out in results[:4]] == [
        f"FAIL  importing no_guard.py: your script exits when it is imported at line {main_line} "
        f"(`main(parse_args(Args))`): {OUTSIDE}",
        f"FAIL  importing hang.py: your script did not finish importing in 3 s: {OUTSIDE}",
        f"FAIL  importing name_error.py: your script raised NameError at line {error_line} "
        "(`RATE = undefined * 2`): name 'undefined' is not defined",
        f"FAIL  importing syntax.py: your script has a syntax error at line {syntax_line}: "
        "invalid syntax",
    ]
    loop_out = results[4][1]
    assert loop_out.count("your script: did not return within 1 s (an endless loop?)") == 2
    assert "your script: has no `compute_advantages`" in results[5][1]
    parent = results[6][1]  # keeps the std and the 1/|o| aggregation: two FAILs, not a third
    assert re.findall(r"^(PASS|FAIL)  (\w+)", parent, re.M) == [
        ("FAIL", "compute_advantages"),
        ("PASS", "a"),  # a group whose rewards are all equal gets exactly zero advantage
        ("FAIL", "loss_weights"),
    ]
    assert (
        "your script: gave the check something it cannot read (AttributeError: 'bool' object has "
        "no attribute 'all'): check the types and shapes the handout asks for" in results[11][1]
    )
    assert last_line(results[12][1]) == (
        f"FAIL  {tmp_path}/no_suffix: not a Python script (its name must end in .py)"
    )
    assert last_line(results[13][1]) == (
        f"FAIL  --run-dir {runs}/grpo__1__17/config.json: a file, not a folder"
    )
    assert [last_line(out) for _, out in results[7:11]] == [
        f"FAIL  --run-dir {runs}/dr_grpo__...: no such folder; the runs next to it: "
        f"{runs}/dr_grpo__1__18",
        f"FAIL  --run-dir {runs}: not a run folder (it has no config.json); the runs inside it: "
        f"{runs}/dr_grpo__1__18, {runs}/grpo__1__17",
        f"FAIL  no --run-dir is a run of my.py with num_minibatches=2: {tmp_path}/runs/stopped has "
        "no metrics.jsonl (did the run stop before step 1?)",
        f"FAIL  no --run-dir is a run of my.py with num_minibatches=2: {runs}/grpo__1__17 is a "
        "run of grpo.py with num_minibatches=2",
    ]


def test_a_failed_check_shows_its_inputs(tmp_path):
    """Lab 07: an is_stale that looks at the newest token and a lag_shares that returns a dict are
    each reported with the inputs they got."""
    script = variant(
        "grpo_async.py",
        tmp_path / "my_grpo_async.py",
        "    return min(min(v) for v in versions) < step - max_lag\n",
        "    return max(max(v) for v in versions) < step - max_lag\n\n\n"
        "def lag_shares(lags, max_lag):\n"
        "    return {k: (lags == k).float().mean().item() for k in range(max_lag + 1)}\n",
    )
    ((code, out),) = grade_in_one_process("07-async-lag", [[script, "--no-run"]])
    assert code == 1 and "Traceback" not in out, out
    assert (
        "your script: is_stale([[3, 3, 4], [4, 4], [5]], step=4, K=0) returned False; "
        "is_stale([[3, 3, 4], [4, 4], [5]], step=5, K=1) returned False; "
        "is_stale([[4, 4], [5, 3, 5]], step=6, K=2) returned False\n" in out
    )
    assert (
        "your script: a dict ({0: 0.625, 1: 0.25, 2: 0.125} for lags [0.0, 0.0, 1.0, 2.0, 1.0, "
        "0.0, 0.0, 0.0], K = 2): return a list of K + 1 floats\n" in out
    )


FAKE_CHECK = """
import sys
sys.path.insert(0, {labs!r})
from grader import Grader, expect, series

g = Grader("99", "fake.py")
rows = g.run(["--num-steps", "3"], required={{}})
with g.check("three steps logged", hint="-"):
    expect(series(rows, "x") == [1, 2, 3], str(series(rows, "x")))
g.finish()
"""

FAKE_SCRIPT = """
import json, os, sys, time
assert "--no-save-final" in sys.argv, sys.argv  # the grader's runs write no final checkpoint
out = os.path.join(sys.argv[sys.argv.index("--output-dir") + 1], "fake__1__1")
os.makedirs(out)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({{"script": "fake.py", "args": {{}}}}, f)
with open(os.path.join(out, "pid"), "w") as f:
    f.write(str(os.getpid()))
for step in (1, 2, 3):
    {body}
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({{"step": step, "x": step}}) + "\\n")
"""


def test_the_run_part_reports_progress_stops_a_hang_and_cleans_up(tmp_path):
    """A stand-in for a lab script (no model): progress lines per step, the temp output removed (or
    kept with --keep), a failed run's last line, a run past --run-timeout stopped with its
    processes."""
    check = tmp_path / "check.py"
    check.write_text(FAKE_CHECK.format(labs=LABS))
    bodies = {
        "good": "time.sleep(1.2)",
        "fails": "print('error: the loss is NaN at step 2') or sys.exit(1) if step == 2 else None",
        "hangs": "time.sleep(600)",
    }
    for name, body in bodies.items():
        (tmp_path / f"{name}.py").write_text(FAKE_SCRIPT.format(body=body))
    env = {**os.environ, "TMPDIR": str(tmp_path)}

    def grade(*args):
        proc = subprocess.run(
            [sys.executable, str(check), *args], cwd=tmp_path, capture_output=True, text=True,
            env=env, timeout=120,
        )  # fmt: skip
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        folder = re.search(r"its output goes to (\S+)/output.log", proc.stdout).group(1)
        return proc.returncode, proc.stdout, folder

    code, out, folder = grade("good.py")
    assert code == 0 and "all 1 checks passed" in out, out
    shown = [int(k) for k in re.findall(r"^  step (\d) of 3 done, \d+ s so far$", out, re.M)]
    assert len(shown) >= 2 and shown == sorted(set(shown)) and shown[-1] == 3, out
    assert not os.path.exists(folder)
    code, out, folder = grade("good.py", "--keep")
    assert code == 0 and f"kept: {folder}" in out and os.path.isdir(folder)
    code, out, folder = grade("fails.py")
    assert code == 1 and last_line(out) == f"kept: {folder}", out
    assert (
        f"FAIL  the run stopped with exit code 1: error: the loss is NaN at step 2 (its whole "
        f"output: {folder}/output.log)" in out
    )
    code, out, folder = grade("hangs.py", "--run-timeout", "3")
    assert code == 1 and (
        f"FAIL  the run did not finish in 3 s (stopped at step 0 of 3); its output: "
        f"{folder}/output.log" in out
    ), out
    pid = int(open(os.path.join(folder, "fake__1__1", "pid")).read())
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@needs_keys
def test_grade_all_writes_one_table_for_a_room(tmp_path):
    """Made-up submissions of lab 07: a solution with its runs, the unchanged parent without runs, a
    script without a __main__ guard, a folder without a script, a solution whose run has other
    settings."""
    subs = tmp_path / "submissions"
    for student in ("alice", "bob", "carol", "dave", "erin"):
        (subs / student).mkdir(parents=True)
    (subs / "alice" / "grpo_async.py").write_text(open(os.path.join(REPO, "grpo_async.py")).read())
    subprocess.run(
        ["git", "apply", os.path.join(LABS, "07-async-lag", "solution.diff")],
        cwd=subs / "alice",
        check=True,
    )
    solution = (subs / "alice" / "grpo_async.py").read_text()
    os.rename(subs / "alice" / "grpo_async.py", subs / "alice" / "my_grpo_async.py")
    (subs / "erin" / "my_grpo_async.py").write_text(solution)
    variant("grpo_async.py", subs / "bob" / "my_grpo_async.py")
    (subs / "carol" / "my_grpo_async.py").write_text(
        solution.replace(GUARD, "main(parse_args(Args))\n")
    )
    (subs / "dave" / "notes.txt").write_text("I ran out of time")
    (subs / "frank.txt").write_text("not a folder")
    filled = [[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.5, 0.3, 0.2]]
    never = [[1.0, 0.0, 0.0]] * 3  # the pipeline never fills: fails check 4
    for student, name, lag, shares, age in (
        ("alice", "k2__1__1", 2, never, 3600), ("alice", "k2__1__2", 2, filled, 0),
        ("erin", "k0__1__1", 0, filled, 0),
    ):  # fmt: skip
        run = subs / student / "runs" / "lab07" / name
        run.mkdir(parents=True)
        config = {"script": "my_grpo_async.py", "args": {"max_lag": lag, "num_steps": 3}}
        (run / "config.json").write_text(json.dumps(config))
        rows = [
            {"step": s + 1, **{f"rollout/lag_share_{k}": x for k, x in enumerate(shares[s])}}
            for s in range(3)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        old = os.path.getmtime(run / "metrics.jsonl") - age
        os.utime(run / "metrics.jsonl", (old, old))
    proc = subprocess.run(  # a path relative to the teacher's folder
        [sys.executable, os.path.join(LABS, "grade_all.py"), "7", "submissions"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    with open(subs / "grades-lab07.csv") as f:
        table = list(csv.reader(f))
    line = line_of(str(subs / "carol" / "my_grpo_async.py"), "main(parse_args(Args))")
    assert table[0][0] == "student" and table[0][1].startswith("is_stale(versions, step, K)")
    assert table[1:] == [
        ["alice", "PASS", "PASS", "PASS", "PASS", "4/4", ""],
        ["bob", "PASS", "FAIL", "-", "-", "1/4", "no run folder submitted: the run checks were not made"],
        ["carol", "-", "-", "-", "-", "0/4", "importing my_grpo_async.py: your script exits when it is "
         f"imported at line {line} (`main(parse_args(Args))`): {OUTSIDE}"],
        ["dave", "-", "-", "-", "-", "0/4", "no script (my_grpo_async.py)"],
        ["erin", "PASS", "PASS", "-", "-", "2/4", "no --run-dir is a run of my_grpo_async.py with "
         f"max_lag=2: {subs}/erin/runs/lab07/k0__1__1 is a run of my_grpo_async.py with max_lag=0"],
        ["frank.txt", "-", "-", "-", "-", "0/4", "not a folder"],
    ]  # fmt: skip
