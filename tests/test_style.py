"""The shape of the code: line budgets, shared blocks kept identical, --help, formatting."""

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys

import conftest
import pytest
from conftest import REPO

from common import flags
from common.flags import flag_ranges, parse_args

SCRIPTS = [f"{name}.py" for name in conftest.SCRIPTS]
# Sizes count the formatted code (STYLE.md, since 2026-12-01): the file as ruff format writes it with
# every `# fmt: skip` taken away, so packing lines buys nothing. Just above the sizes: growth past
# them is a decision, not drift. STYLE.md's caps: sft/rm/dpo 420, grpo.py 600, ppo.py 850 (ppo.py was
# over it until 2026-12-03: 855). The history of each number, raw lines then, is in this file's git log; the fifth
# house pass (2026-12-03) took the trainer shell's inputs from the flags themselves (the
# Optimization group, no settings dict, no trainer_shell() copies) and made main's end one call
# (checkpoint.finish): grpo.py 623 -> 584, ppo.py 910 -> 865, dpo.py 428 -> 391, sft.py 349 -> 312,
# rm.py 394 -> 358 formatted; common/ 4,708 -> 4,752 for it. compute_logprobs names what the
# swapped head returns (logprobs, not out.logits): +1 in each script but rm.py. The GRPO family's
# --is-correction seq-mask (a response masked whole by its geometric-mean ratio, its band
# --seq-mask-cap, train/seq_masked): +10 each. memory.check_run reads the flags it planned from
# (tokens, the longest row, top-p, colocation, critics) itself: -1 to -11 each, common/ -10.
# grpo_async.py's resume that loses and repeats nothing, and --deterministic: 674 -> 737.
# spawn_engines reads the flags it needs (seed, engine tp, the longest row, memory, sleep mode,
# LoRA, dtype) itself: -13 in the GRPO family (-4 in grpo_async.py), ppo.py 855 -> 843, common/ -9.
# Vision-language models (common/vision.py): compute_logprobs takes a VLM's pixel tensors (+1 in
# each script but rm.py), reward_fn checks one-word answers (+3), the GRPO family's train_step
# hands the pixels on (+3), sft.py and grpo.py read the pictures (+11, +4), the scripts that train
# language models only say so (+1): sft.py 328, grpo.py 583, ppo.py 848. The GRPO family's last
# `# fmt: skip`s written out and the variants' diffs given 10 % headroom (2026-12-04): grpo.py 580,
# dapo.py 620, grpo_async.py 730, grpo_tools.py 722, distill.py 654.
BUDGET = {
    "sft.py": 328,
    "rm.py": 357,
    "dpo.py": 399,
    "grpo.py": 580,
    "ppo.py": 848,  # the policy's and the critic's update; STYLE.md's cap 850
    "dapo.py": 620,  # grpo.py + its tagged diff (120 changed lines); its rounds carry reward terms
    "grpo_async.py": 730,  # grpo.py + its tagged diff (300): in flight kept by checkpoints
    "grpo_tools.py": 722,  # grpo.py + its tagged diff (205): the tool turns, the episode
    "distill.py": 654,  # grpo.py + its tagged diff (200): the teacher's prompt, scoring, advantage
}
# lines of main(): the loop fits on a screen
MAIN_BUDGET = {"sft.py": 80, "rm.py": 80, "dpo.py": 80, "ppo.py": 200}  # 150 for the others
PRESENT = [s for s in SCRIPTS if os.path.exists(os.path.join(REPO, s))]
# Blocks that must stay byte-identical in the scripts listed (change them everywhere at once).
RL = ["grpo.py", "dapo.py", "ppo.py", "grpo_async.py", "grpo_tools.py", "distill.py"]
GRPO = ["grpo.py", "dapo.py", "grpo_async.py", "grpo_tools.py"]  # grpo.py and its variants
SUPERVISED = ["sft.py", "rm.py", "dpo.py"]  # one trainer group, no engines
SHARED = [  # (block, scripts); "script:Class.method" names a block under another name
    ("compute_logprobs", ["sft.py", "dpo.py", *RL]),
    ("reward_fn", ["sft.py", "dpo.py", *RL]),
    ("check_machine", SUPERVISED),
    ("check_machine", ["grpo.py", "dapo.py", "grpo_tools.py", "distill.py"]),  # async: no colocate
    ("start_actors", ["grpo.py", "dapo.py", "grpo_tools.py", "distill.py"]),
    ("plan_minibatches", [*GRPO, "distill.py"]),
    # a loss change lives in compute_loss / loss_weights; the update is the same in the family
    ("train_step", GRPO),
]


def source(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def formatted_lines(name) -> int:
    """Lines of a file as STYLE.md counts them: ruff format's output, every `# fmt: skip` removed."""
    text = re.sub(r"[ \t]*# fmt: skip\b.*", "", source(name))
    ruff = [sys.executable, "-m", "ruff", "format", "--line-length", "100", "-"]
    out = subprocess.run(ruff, input=text, capture_output=True, text=True, check=True, cwd=REPO)
    return out.stdout.count("\n")


@pytest.mark.parametrize("script", PRESENT)
def test_line_budget(script):
    lines = formatted_lines(script)
    assert lines <= BUDGET[script], f"{script} has {lines} lines, budget {BUDGET[script]}"
    tree = ast.parse(source(script))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    limit = MAIN_BUDGET.get(script, 150)
    assert main.end_lineno - main.lineno + 1 <= limit, f"main() of {script} is over {limit} lines"


def test_common_stays_small():
    """One number for all of common/, every module counted, formatted (STYLE.md: 4,000). The history
    of the cap, raw lines then and modules carved out of it, is in this file's git log. Counted
    formatted with no carve-outs (2026-12-03) it is 4,744 (4,708 before the shell's inputs and
    main's end moved in, 250 lines out of the scripts), over STYLE.md's 4,000: the fifth house
    pass's open item; it may not grow. 4,737 since grpo_async.py's deterministic mode (AsyncEngine's
    signatures on one line each paid for it); 4,728 since spawn_engines reads the flags; 5,078 with
    vision-language models (common/vision.py, 266 lines: images, their tokens, the built-in VLM;
    the loaders, packing, engines and probe taking pictures: 84); 5,093 with LoRA on a VLM's language
    model (its targets matched under text_model.layers) and transformers' warning about its own
    default Idefics3 config filtered out. 5,034 (2026-12-04) with simpler code, nothing dropped:
    the sandbox's bwrap line and closing note, lora.spec folded into lora.adapters and
    lora.engine_lora into spawn_engines, Engine's arguments as AsyncEngine's, data.load_function
    (a one-line wrapper of isolate.UserFunction) gone, vision.freeze reusing vision.processor."""
    files = sorted(f for f in os.listdir(os.path.join(REPO, "common")) if f.endswith(".py"))
    sizes = {f: formatted_lines(os.path.join("common", f)) for f in files}
    for f, n in sizes.items():  # one room each (memory.py, the plan, is the largest)
        assert n <= 330, f"common/{f} has {n} lines"
    total = sum(sizes.values())
    assert total <= 5034, f"common/ has {total} lines (formatted)"


def test_fmt_skip_is_rare():
    """STYLE.md: a `# fmt: skip` only where an aligned table or formula reads better, never to fit a
    budget (budgets count the formatted code anyway). The scripts and common/ have none since the
    GRPO family's last 13 were written out (2026-12-04: the sample rows as dicts of a zip, the
    variants' engine arguments in a dict, grpo_tools.py's turn loop), so the variants' tagged diffs
    (test_variants_keep_headroom) compare the code as ruff writes it."""
    files = PRESENT + [os.path.join("common", f) for f in os.listdir(os.path.join(REPO, "common"))]
    counts = {f: len(re.findall(r"# fmt: skip\b", source(f))) for f in files if f.endswith(".py")}
    assert not {f: n for f, n in counts.items() if n}


# each variant's tagged diff against grpo.py: (its tag, its budget); each test file holds its own
VARIANTS = {
    "dapo.py": ("DAPO", 120),
    "grpo_async.py": ("ASYNC", 300),
    "grpo_tools.py": ("TOOLS", 205),
    "distill.py": ("DISTILL", 200),
}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v in PRESENT])
def test_variants_keep_headroom(variant):
    """STYLE.md: a variant's diff stays within its budget with >= 10 % headroom, so the next paper's
    change has room without raising the number."""
    import check_variant  # scripts/ (conftest puts it on the path)

    tag, budget = VARIANTS[variant]
    changed, _, _ = conftest.tagged_diff("grpo.py", variant, check_variant.tag_pattern(tag))
    assert changed <= 0.9 * budget, (
        f"{variant} changes {changed} lines of grpo.py, over 90 % of {budget}"
    )


IMPORT_EACH = """
import importlib, sys
for name in sys.argv[1:]:  # each as the first of common/ to be imported
    for m in [m for m in sys.modules if m == "common" or m.startswith("common.")]:
        del sys.modules[m]
    importlib.import_module("common." + name)
"""


def test_common_imports_have_no_circle():
    """common/'s modules import one another one way: no circle, also through an import inside a
    function (a back-arrow), and each imports alone, first, in a fresh interpreter."""
    names = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "common")) if f.endswith(".py"))
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse(source(os.path.join("common", f"{name}.py")))):
            if isinstance(node, ast.ImportFrom) and node.module == "common":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("common.")}
        graph[name] = deps - {name}
    done = set()

    def visit(name, path):
        assert name not in path, "import circle: " + " -> ".join([*path, name])
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, [*path, name])
            done.add(name)

    for name in names:
        visit(name, [])
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *names],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("script", PRESENT)
def test_help_works(script, capsys):
    """`--help` lists every flag, with its docstring (real processes of every script are started in
    test_bad_input.py's test_one_error_line_in_a_real_process)."""
    module = importlib.import_module(script[:-3])
    with pytest.raises(SystemExit) as e:
        parse_args(module.Args, ["--help"])
    out = re.sub(r"[\s│]+", " ", capsys.readouterr().out)  # the box's lines joined
    assert e.value.code == 0 and "--num-trainers" in out and "--seed" in out, script
    assert "seed of model init, data order and sampling" in out
    ranges = flag_ranges(module.Args)  # every numeric flag has one (Annotated), and --help shows it
    assert "num_trainers" in ranges and "learning_rate" in ranges
    for name, rule in ranges.items():
        default = getattr(module.Args, name)
        assert f"(default: {default}; {rule})" in out, (script, name)


def test_shared_blocks_are_identical():
    if len(PRESENT) < 2:
        pytest.skip("one script: nothing to compare yet")
    groups = (flags.Experiment, flags.Resources, flags.Engines, flags.LoRA)
    shared = {f.name for group in groups for f in dataclasses.fields(group)}
    for script in PRESENT:  # common/flags.py's groups, declared nowhere else
        args = importlib.import_module(script[:-3]).Args
        assert not shared & set(vars(args)["__annotations__"]), script
        # Optimization's too; a script may give one of its flags its own default (sft's warm-up)
        assert {flags.Experiment, flags.Resources, flags.LoRA, flags.Optimization} < set(
            args.__mro__
        )
    for name, scripts in SHARED:
        where = [(s.split(":")[0], s.split(":")[-1] if ":" in s else name) for s in scripts]
        blocks = {s: block_source(s, n) for s, n in where if s in PRESENT}
        assert all(blocks.values()), (
            f"{name} is missing from {[s for s, b in blocks.items() if not b]}"
        )
        first = next(iter(blocks))
        for script, block in blocks.items():
            assert block == blocks[first], f"{name} differs between {first} and {script}"


def block_source(script, name):
    """Source of a top-level function or class `name`, or of a method `Class.name`; None if there is
    none."""
    text = source(script)
    nodes = ast.parse(text).body
    for part in name.split("."):
        node = next(
            (n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if node is None:
            return None
        nodes = node.body
    return ast.get_source_segment(text, node)


def test_scripts_import_without_side_effects(tmp_path):
    """Importing a script (to copy a function, or in a test) starts nothing and writes nothing: no
    Ray, no process group, no CUDA context, no file in the working directory, nothing printed."""
    imports = "; ".join(f"import {s[:-3]}" for s in PRESENT)
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); sys.argv = ['x']; {imports}\n"
        "import ray, torch, torch.distributed as dist\n"
        "assert not ray.is_initialized(), 'Ray started'\n"
        "assert not dist.is_initialized(), 'a process group started'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "", out.stdout[-2000:]
    assert os.listdir(tmp_path) == [], f"importing wrote {os.listdir(tmp_path)}"


def test_lines_fit_in_100_columns():
    """The formatter wraps code at 100 columns; docstrings and comments are wrapped by hand, so a
    test keeps them there too (in characters: the math uses Unicode symbols)."""
    files = PRESENT + [os.path.join("common", f) for f in os.listdir(os.path.join(REPO, "common"))]
    for name in [f for f in files if f.endswith(".py")]:
        long = [i for i, line in enumerate(source(name).splitlines(), 1) if len(line) > 100]
        assert not long, f"{name}: lines over 100 characters: {long[:10]}"


def test_ruff_format_and_lint():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed in this environment")
    fmt = subprocess.run([ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
