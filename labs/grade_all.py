"""Grade a room: one lab's grader over a folder of submissions, one table.

    python labs/grade_all.py 03 submissions/            # writes submissions/grades-lab03.csv, prints the table

`submissions/` holds one folder per student, named after the student, with their script (my_dr_grpo.py for lab
03: the name the handout gives, or any single .py file) and the run folders of the handout's commands (each with
its config.json and metrics.jsonl, at any depth; no checkpoints needed). Each student is graded by the lab's
check.py with --run-dir for every run folder found (in seconds: nothing is trained) or --no-run when there is
none, in a process of its own with a time limit, so one student's script cannot stop the others. The table has one
row per student and one column per check (PASS, FAIL, or - when the check did not run), the count passed, and the
note the grader ended with (a script that would not import, a missing run, ...).
"""

import argparse
import concurrent.futures
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

LABS = os.path.dirname(os.path.abspath(__file__))


def find_lab(name: str) -> str:
    """A lab folder from its number or name ("3", "03", "03-dr-grpo")."""
    labs = sorted(d for d in os.listdir(LABS) if re.fullmatch(r"\d\d-[a-z0-9-]+", d))
    found = [d for d in labs if d == name or d[:2] == name.zfill(2)]
    if not found:
        sys.exit(f"error: no lab {name!r}; the labs: {', '.join(labs)}")
    return os.path.join(LABS, found[0])


def handout_script(lab: str) -> str:
    """The name of the student's copy that the handout gives (`**your copy:** `my_x.py``)."""
    with open(os.path.join(lab, "README.md")) as f:
        return re.search(r"\*\*your copy:\*\* `([^`]+)`", f.read()).group(1)


def submission(folder: str, wanted: str) -> tuple[str | None, list[str], str]:
    """(the student's script, their run folders, a note when the script is missing or ambiguous)."""
    scripts, runs = [], []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        if "config.json" in files:  # the grader says what is wrong with one that lacks its metrics
            runs.append(root)
            dirs[:] = []  # a run folder's checkpoints hold no runs
        scripts += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    named = [s for s in scripts if os.path.basename(s) == wanted]
    if named or len(scripts) == 1:
        return (named or scripts)[0], runs, ""
    if not scripts:
        return None, runs, f"no script ({wanted})"
    return None, runs, f"{len(scripts)} .py files and none is {wanted}"


def grade(lab: str, folder: str, wanted: str, timeout: float) -> dict:
    """The grader's results for one student: {"checks": [...], "error": note or None}."""
    if not os.path.isdir(folder):
        return {"checks": [], "error": "not a folder"}
    script, runs, note = submission(folder, wanted)
    if script is None:
        return {"checks": [], "error": note}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(lab, "check.py"), script, "--json", out]
        cmd += [arg for run in runs for arg in ("--run-dir", run)] or ["--no-run"]
        # its own session: a timeout ends the grader and all it started
        proc = subprocess.Popen(
            cmd, cwd=os.path.dirname(LABS), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"checks": [], "error": f"the grader did not finish in {timeout:g} s"}
        if not os.path.isfile(out):  # the grader itself failed: its last line says why
            lines = output.strip().splitlines() or ["(no output)"]
            return {"checks": [], "error": f"the grader stopped: {lines[-1]}"}
        with open(out) as f:
            result = json.load(f)
    if not runs and not result["error"]:
        result["error"] = "no run folder submitted: the run checks were not made"
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lab", help="the lab's number or folder name, e.g. 03")
    parser.add_argument("submissions", help="a folder with one folder per student")
    parser.add_argument("--out", help="the CSV to write (default: SUBMISSIONS/grades-labNN.csv)")
    parser.add_argument("--jobs", type=int, default=2, help="students graded at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per student")
    opts = parser.parse_args()
    lab = find_lab(opts.lab)
    if not os.path.isdir(opts.submissions):
        sys.exit(f"error: no such folder: {opts.submissions}")
    submissions = os.path.abspath(opts.submissions)  # the graders run in the repository
    students = sorted(d for d in os.listdir(submissions) if not d.startswith((".", "grades-")))
    if not students:
        sys.exit(f"error: {opts.submissions} has no student folders")
    wanted = handout_script(lab)
    print(f"grading {len(students)} submissions of {os.path.basename(lab)} ({wanted})", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        futures = {
            s: pool.submit(grade, lab, os.path.join(submissions, s), wanted, opts.timeout)
            for s in students
        }
        results = {}
        for s in students:
            results[s] = futures[s].result()
            print(f"  {s}: {summary(results[s])}", flush=True)

    checks = []  # every check any student reached, in the graders' order
    for result in results.values():
        checks += [c["check"] for c in result["checks"] if c["check"] not in checks]
    numbers = [f"check {i}" for i in range(1, len(checks) + 1)]
    rows = []
    for s in students:
        status = {c["check"]: "PASS" if c["passed"] else "FAIL" for c in results[s]["checks"]}
        passed = sum(v == "PASS" for v in status.values())
        note = results[s]["error"] or ""
        rows.append([s, *[status.get(c, "-") for c in checks], f"{passed}/{len(checks)}", note])
    out = opts.out or os.path.join(submissions, f"grades-lab{os.path.basename(lab)[:2]}.csv")
    with open(out, "w", newline="") as f:  # the CSV names each check in full
        csv.writer(f).writerows([["student", *checks, "passed", "note"], *rows])
    header = ["student", *numbers, "passed", "note"]
    print("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n" + "\n".join(f"check {i}: {c}" for i, c in enumerate(checks, 1)))
    print(f"\nwritten: {out}")


def summary(result: dict) -> str:
    passed = sum(c["passed"] for c in result["checks"])
    text = f"{passed} of {len(result['checks'])} checks passed"
    return text + (f"; {result['error']}" if result["error"] else "")


if __name__ == "__main__":
    main()
