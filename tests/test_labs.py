"""The course labs keep working as the scripts change: every lab's solution.diff applies to its
parent script and the result passes the lab's function checks; the unmodified parent fails them (a
grader that cannot fail is no grader); the commands in a lab's README parse with the solved script;
every lab has its files and is linked."""

import difflib
import json
import os
import re
import shutil
import subprocess
import sys

import check_variant
import pytest
from conftest import KEYS, STUDENTS_COPY, needs_keys
from test_grader import grade_in_one_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABS_DIR = os.path.join(REPO, "labs")
LABS = sorted(d for d in os.listdir(LABS_DIR) if re.fullmatch(r"\d\d-[a-z0-9-]+", d))

# One process per lab (imports are most of the cost): the grader's function checks on the solved
# script, then on the unmodified parent, then every `python my_x.py ...` command of the lab's README
# parsed by the solved script's own Args and validate_args. Prints one JSON line.
LAB_PROGRAM = """
import contextlib, importlib.util, io, json, runpy, shlex, sys
import tyro
check, solved, parent, *commands = sys.argv[1:]

def grade(script):
    out, code = io.StringIO(), 0
    sys.argv = [check, script, "--no-run"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(check, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

scripts = {"my": load(solved, "solved_for_commands"), "parent": load(parent, "parent_for_commands")}
parsed = []
for line in commands:
    which, line = line.split(":", 1)
    m = scripts[which]
    try:
        m.validate_args(tyro.cli(m.Args, args=shlex.split(line, comments=True)))
        parsed.append("ok")
    except BaseException as e:
        parsed.append(f"{line}: {type(e).__name__} {e}")
print(json.dumps({"solved": grade(solved), "parent": grade(parent), "commands": parsed}))
"""


def parent_of(lab: str) -> str:
    """The script a lab starts from, as its handout names it (`**Parent script:** `grpo.py``)."""
    with open(os.path.join(LABS_DIR, lab, "README.md")) as f:
        return re.search(r"\*\*Parent script:\*\* `([^`]+)`", f.read()).group(1)


def readme_commands(lab: str, parent: str) -> list[str]:
    """Every `python my_<name>.py ...` ("my:flags") and `python <parent> ...` ("parent:flags") command in the
    lab's README, continuation lines joined."""
    with open(os.path.join(LABS_DIR, lab, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    pattern = r"python (my_\w+\.py|" + re.escape(parent) + r")([^\n`|]*)"
    return [
        ("my:" if m.group(1).startswith("my_") else "parent:") + m.group(2)
        for m in re.finditer(pattern, text)
    ]


def test_every_lab_has_its_files_and_is_linked():
    assert len(LABS) >= 7
    missing = [k for k in KEYS if not os.path.exists(k)]
    assert STUDENTS_COPY or not missing, f"missing: {missing} (withhold all the keys or none)"
    with open(os.path.join(LABS_DIR, "README.md")) as f:
        guide = f.read()
    with open(os.path.join(REPO, "README.md")) as f:
        assert "labs/README.md" in f.read()
    for lab in LABS:
        for name in ("README.md", "check.py", "expected.png"):
            assert os.path.isfile(os.path.join(LABS_DIR, lab, name)), f"{lab}/{name} is missing"
        assert f"({lab}/README.md)" in guide, f"labs/README.md does not link {lab}"
        with open(os.path.join(LABS_DIR, lab, "README.md")) as f:
            text = f.read()
        assert "expected.png" in text and "python plot.py" in text, (
            f"{lab}: no command beside expected.png"
        )


def test_every_handout_starts_in_the_environment():
    """Each handout's first command is the project's environment, and its training commands write
    no final checkpoint, but for a run whose final model a later command reads (lab 08's teacher)."""
    for lab in LABS:
        with open(os.path.join(LABS_DIR, lab, "README.md")) as f:
            text = f.read()
        first = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
        assert "source .venv/bin/activate" in first, f"{lab}: first command {first!r}"
        commands = readme_commands(lab, parent_of(lab))
        for i, command in enumerate(commands):
            name = re.search(r"--exp-name (\S+)", command)
            read_later = name and any(
                f"{name.group(1)}__" in c and "checkpoints/final" in c for c in commands[i + 1 :]
            )
            assert "--no-save-final" in command or read_later, f"{lab}: {command}"


@needs_keys
def test_every_question_has_an_answer():
    """labs/ANSWERS.md answers every question of every handout: one **Qn.** per numbered question,
    in a section per lab."""
    with open(os.path.join(LABS_DIR, "ANSWERS.md")) as f:
        answers = re.split(r"^## Lab (\d\d)\b", f.read(), flags=re.M)
    keys = dict(zip(answers[1::2], answers[2::2]))
    for lab in LABS:
        with open(os.path.join(LABS_DIR, lab, "README.md")) as f:
            text = f.read()
        questions = re.findall(r"^(\d)\. ", text.split("\n## Questions\n")[1], re.M)
        assert questions == [str(i) for i in range(1, len(questions) + 1)] and questions, lab
        found = re.findall(r"^\*\*Q(\d)\.\*\*", keys.get(lab[:2], ""), re.M)
        assert found == questions, f"labs/ANSWERS.md, lab {lab[:2]}: answers {found}"


@needs_keys
@pytest.mark.parametrize("lab", LABS)
def test_solution_applies_passes_its_grader_and_the_parent_fails(lab, tmp_path):
    parent = parent_of(lab)
    diff = os.path.join(LABS_DIR, lab, "solution.diff")
    shutil.copy(os.path.join(REPO, parent), tmp_path / parent)
    subprocess.run(["git", "apply", "--check", diff], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", diff], cwd=tmp_path, check=True)
    commands = readme_commands(lab, parent)
    check = os.path.join(LABS_DIR, lab, "check.py")
    program = [
        sys.executable,
        "-c",
        LAB_PROGRAM,
        check,
        str(tmp_path / parent),
        os.path.join(REPO, parent),
    ]
    proc = subprocess.run(
        [*program, *commands], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (code, out), (parent_code, parent_out) = result["solved"], result["parent"]
    assert code == 0 and re.search(r"all \d+ checks passed", out), f"solution of {lab}:\n{out}"
    failed_check = re.search(
        r"^FAIL  (?!importing)", parent_out, re.M
    )  # a check failed, not the import
    assert parent_code == 1 and failed_check, (
        f"the grader of {lab} passes the unmodified {parent}:\n{parent_out}"
    )
    assert any(c.startswith("my:") for c in commands), (
        f"{lab}/README.md has no `python my_...py` command"
    )
    assert result["commands"] == ["ok"] * len(commands), f"{lab}/README.md: {result['commands']}"


def plumbing_edits(parent: str, diff: str) -> list[tuple[float, str]]:
    """scripts/check_variant.py's plumbing_edits on files: the parent script, a diff of it."""
    with open(parent) as p, open(diff) as d:
        return check_variant.plumbing_edits(p.read().splitlines(), d.read())


def test_the_plumbing_check_can_fail(tmp_path):
    """check_variant's protected_lines and touched_lines find an edit inside a TRY NOT TO MODIFY
    block of grpo.py."""
    with open(os.path.join(REPO, "grpo.py")) as f:
        lines = f.read().splitlines()
    protected = check_variant.protected_lines(lines)
    step = next(i for i, line in enumerate(lines, 1) if "def plan_minibatches" in line)
    main = next(i for i, line in enumerate(lines, 1) if line.startswith("def main("))
    assert step in protected and main not in protected and main + 5 not in protected
    assert next(i for i, line in enumerate(lines, 1) if "def compute_loss" in line) not in protected
    edited = list(lines)
    edited[step] += "  # an edit of the plumbing"
    diff = "\n".join(difflib.unified_diff(lines, edited, "a/grpo.py", "b/grpo.py", lineterm=""))
    with open(os.path.join(tmp_path, "edit.diff"), "w") as f:
        f.write(diff + "\n")
    found = [w for w, _ in plumbing_edits(os.path.join(REPO, "grpo.py"), f.name)]  # - and +
    assert len(found) == 2 and all(abs(w - (step + 1)) <= 0.5 for w in found), (found, step + 1)


@needs_keys
def test_a_run_check_reads_the_run_and_can_fail(tmp_path):
    """Lab 06's run part on two made-up run dirs: the stale steps' logprob gap must be 10x the fresh
    ones' (it is in the first, not in the second)."""
    lab, parent = "06-weight-sync", "grpo.py"
    shutil.copy(os.path.join(REPO, parent), tmp_path / parent)
    subprocess.run(
        ["git", "apply", os.path.join(LABS_DIR, lab, "solution.diff")], cwd=tmp_path, check=True
    )
    runs = []
    for name, diffs in (
        ("good", [0.002, 0.08, 0.003, 0.09]),
        ("flat", [0.002, 0.004, 0.003, 0.005]),
    ):
        run_dir = tmp_path / name / "sync_every_2__1__0"
        run_dir.mkdir(parents=True)
        config = {"script": parent, "args": {"sync_every": 2}}
        (run_dir / "config.json").write_text(json.dumps(config))
        rows = [
            {"step": s + 1, "train/logprob_diff_mean": d, "train/tis_weight": w}
            for s, (d, w) in enumerate(zip(diffs, [1.0, 1.02, 1.0, 0.97]))
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append([str(tmp_path / parent), "--run-dir", str(run_dir)])
    (good, good_out), (flat, flat_out) = grade_in_one_process(lab, runs)
    assert good == 0 and "FAIL" not in good_out, good_out
    assert flat == 1 and "FAIL  steps sampled from stale weights" in flat_out, flat_out
