"""The shape of the code: line budgets, shared blocks kept identical, --help, formatting."""

import ast
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPTS = ["sft.py", "rm.py", "dpo.py", "grpo.py", "dapo.py", "ppo.py"]
BUDGET = {"sft.py": 600, "rm.py": 600, "dpo.py": 650, "grpo.py": 800, "ppo.py": 1000, "dapo.py": 920}
PRESENT = [s for s in SCRIPTS if os.path.exists(os.path.join(REPO, s))]
# Blocks that must stay byte-identical in every script that has them (change them everywhere at once).
SHARED_FUNCTIONS = ["load_policy", "compute_logprobs", "reward_fn"]


def source(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


@pytest.mark.parametrize("script", PRESENT)
def test_line_budget(script):
    lines = source(script).count("\n")
    assert lines <= BUDGET[script], f"{script} has {lines} lines, budget {BUDGET[script]}"
    tree = ast.parse(source(script))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 300, "main() is over 300 lines"


def test_common_stays_small():
    files = [f for f in os.listdir(os.path.join(REPO, "common")) if f.endswith(".py")]
    total = 0
    for f in files:
        n = source(os.path.join("common", f)).count("\n")
        assert n <= 300, f"common/{f} has {n} lines"
        total += n
    # STYLE.md's target is ~1,000; the GPU/cluster layer (Layout, the rank-0 loader, start-up waits) took it past
    # 1,400 and the failure handling (checks.py: ranges, pre-flight checks, RunError, reward calls) to ~1,800.
    # Over this cap, delete or simplify before adding.
    assert total <= 1850, f"common/ has {total} lines"


def test_help_works():
    """`python <script> --help` for every script, started together (each spends ~8 s importing torch and vLLM)."""
    procs = {
        script: subprocess.Popen([sys.executable, script, "--help"], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        for script in PRESENT
    }  # fmt: skip
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{script}: {err[-2000:]}"
        assert "--num-trainers" in out and "--seed" in out, script


def experiment_block(text):
    start = text.index("    # Experiment\n")
    return text[start : text.index("    # Model and data\n")]


def test_shared_blocks_are_identical():
    if len(PRESENT) < 2:
        pytest.skip("one script: nothing to compare yet")
    ref = PRESENT[0]
    for script in PRESENT[1:]:
        assert experiment_block(source(script)) == experiment_block(source(ref)), f"Experiment block: {script}"
        for fn in SHARED_FUNCTIONS:
            a, b = function_source(ref, fn), function_source(script, fn)
            if a and b:
                assert a == b, f"{fn} differs between {ref} and {script}"


def function_source(script, name):
    text = source(script)
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    return None


def test_scripts_import_without_side_effects():
    code = "import sys; sys.argv=['x']; " + "; ".join(f"import {s[:-3]}" for s in PRESENT) + "; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    assert not os.path.exists(os.path.join(REPO, "runs", "__import_check__"))


def test_ruff_format_and_lint():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed in this environment")
    fmt = subprocess.run([ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
