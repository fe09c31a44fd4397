"""The CUDA-only parts of the scripts, checked on CPU: every documented command passes argument
validation, flash-attn is chosen only where it runs, the weight push waits for the optimizer step
and frees the CUDA cache, and a colocated trainer hands its cached memory back before the engine
wakes."""

import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import tyro
from conftest import REPO, SCRIPTS, trainer_rank
from transformers import LlamaConfig

from common import trainer as common_model
from common.data import split_for_ranks
from common.packed_attn import PACKED


def docstring_commands(module) -> list[list[str]]:
    """The `python <script>.py ...` commands of a script's "Run it:" section, as argv lists
    (comments dropped)."""
    text = module.__doc__.split("Run it:", 1)[1]
    commands, current = [], ""
    for line in text.splitlines():
        current += " " + line.strip()
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        argv = shlex.split(current, comments=True)
        if argv:
            commands.append(argv)
        current = ""
    return commands


@pytest.mark.parametrize("name", SCRIPTS)
def test_documented_commands_pass_validation(name):
    module = importlib.import_module(name)
    commands = docstring_commands(module)
    assert len(commands) >= 3, commands  # CPU demo, 1 GPU, 8 GPUs
    for argv in commands:
        assert argv[:2] == ["python", f"{name}.py"], argv
        args = tyro.cli(module.Args, args=argv[2:])
        module.validate_args(args)  # raises SystemExit("error: ...") on a rejected combination
        assert args.max_tokens_per_micro_batch is not None


@pytest.mark.parametrize(
    "name,flags,longest,budget",
    [("grpo", ["--max-response-length", "1024"], 1280, 1280), ("dapo", [], 280, 512),
     ("ppo", ["--max-prompt-length", "900"], 924, 924), ("sft", ["--max-length", "2048"], 2048, 2048),
     ("rm", ["--max-length", "700"], 1400, 1400), ("dpo", [], 1024, 1024)],
)  # fmt: skip
def test_micro_batch_budget_follows_the_sequence_length(name, flags, longest, budget):
    """Default: the script's usual budget, or one longest sequence (pair) when that is more. A
    budget the user sets is never raised behind their back: too small, it is rejected with one
    line."""
    module = importlib.import_module(name)
    args = tyro.cli(module.Args, args=flags)
    module.validate_args(args)
    assert args.max_tokens_per_micro_batch == budget
    too_small = tyro.cli(
        module.Args, args=[*flags, "--max-tokens-per-micro-batch", str(longest - 1)]
    )
    with pytest.raises(
        SystemExit, match=f"^error: --max-tokens-per-micro-batch must fit .*{longest}"
    ):
        module.validate_args(too_small)


@pytest.mark.parametrize(
    "capability,installed,want",
    [
        ((8, 0), True, "flash_attention_2"),
        ((9, 0), True, "flash_attention_2"),
        ((7, 5), True, PACKED),
        ((8, 0), False, PACKED),
    ],
)
def test_flash_attention_only_where_it_runs(monkeypatch, capability, installed, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        common_model.importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if installed else None) if name == "flash_attn" else real_find_spec(name, *a)
        ),
    )
    cuda, config = torch.device("cuda", 0), LlamaConfig()
    for dtype in (torch.bfloat16, torch.float16):
        assert common_model.attn_implementation(cuda, dtype, config) == want
    # flash-attn takes 16 bits; elsewhere SDPA, each packed sequence attending only to itself
    assert common_model.attn_implementation(cuda, torch.float32, config) == PACKED
    assert common_model.attn_implementation(torch.device("cpu"), torch.float32, config) == PACKED


def one_micro_batch(module, **per_token):
    seq = module.make_sequence([5, 6, 7], [8, 9], **{k: [v, v] for k, v in per_token.items()})
    return split_for_ranks([seq], 1, 64)  # [rank 0: [micro-batch]]


@pytest.mark.parametrize("name", ["grpo", "dapo", "ppo"])
def test_colocated_trainer_frees_cuda_cache_after_train_step(
    monkeypatch, one_rank_group, tiny_model, name
):
    """Colocated, vLLM wakes its weights on this GPU right after train_step: the step's cached
    blocks go back first."""
    module = importlib.import_module(name)
    addr, port = one_rank_group
    args = module.Args(colocate=True, learning_rate=1e-4)
    trainer = trainer_rank(module, args, tiny_model, addr, port)
    extra = {"old_logprobs": -1.0} if name == "ppo" else {"engine_logprobs": -1.0}
    micro_batches = one_micro_batch(module, advantages=1.0, loss_weights=0.5, **extra)
    freed = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(True))
    trainer.run(module.train_step, micro_batches, 0)  # as call(trainers, train_step, ...) does
    assert freed, f"{name}.py's colocated trainer did not call torch.cuda.empty_cache()"
    freed.clear()
    trainer.args.colocate = False
    trainer.run(module.train_step, micro_batches, 1)
    assert not freed  # not colocated: the cache stays, the next step reuses it


def test_engines_log_vllm_warnings_less_the_known_ones(tmp_path):
    """vLLM's logging as the engines configure it (common/vllm_logging.json): a warning reaches the
    output, an info line does not, and a known one (a deliberate setting, a check made precise
    elsewhere) is dropped."""
    code = (
        "import json, logging, logging.config, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        f"logging.config.dictConfig(json.load(open({os.path.join(REPO, 'common', 'vllm_logging.json')!r})))\n"
        "log = logging.getLogger('vllm.model_executor.model_loader.reload.layerwise')\n"
        "log.warning('Something new went wrong'); log.info('an info line')\n"
        "log.warning('RotaryEmbedding: Failed to load weights')\n"
        # the first GPU run: once per norm/projection, the built-in fp32 checkpoint served in bf16
        "import torch; fmt = 'Attempted to load weight %s with dtype %s into parameter with dtype %s'\n"
        "log.warning(fmt, 'norm.weight', torch.float32, torch.bfloat16)\n"
        "log.warning(fmt, 'lm_head.weight', torch.bfloat16, torch.float16)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Something new went wrong" in out.stdout and "WARNING" in out.stdout
    assert "an info line" not in out.stdout and "Failed to load weights" not in out.stdout
    assert "norm.weight" not in out.stdout and "lm_head.weight" in out.stdout  # bf16 -> fp16 stays


def test_gpu_check_has_its_steps_and_refuses_without_a_gpu(tmp_path):
    """benchmark/gpu_check.sh: steps 0-5 and `report`, each one a case of the script; on a machine
    without a GPU a step stops with one line, and an unknown step is named."""
    script = os.path.join(REPO, "benchmark", "gpu_check.sh")
    with open(script) as f:
        text = f.read()
    assert re.findall(r"^(\w+)\)$", text, re.M) == ["0", "1", "2", "3", "4", "5", "report"]
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        WORK=str(tmp_path),
        PATH=f"{tmp_path}:{os.environ['PATH']}",
    )
    (tmp_path / "nvidia-smi").write_text(
        "#!/bin/sh\nexit 9\n"
    )  # whatever this machine has: no GPU here
    (tmp_path / "nvidia-smi").chmod(0o755)
    out = subprocess.run(["bash", script, "3"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: no NVIDIA GPU visible (nvidia-smi -L); this check is for GPU machines"
    ]
    out = subprocess.run(
        ["bash", script, "report"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0
    # a given Python without the pinned stack is named, not used (nor replaced by a set-up)
    fake = tmp_path / "python-without-vllm"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(
        ["bash", script, "0"], capture_output=True, text=True, env={**env, "PYTHON": str(fake)},
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: $PYTHON={fake} does not import the pinned stack: ModuleNotFoundError: No module "
        "named 'vllm'"
    ]


def fake_repo_with_gpu(tmp_path, driver: str, cap: str | None, stack: str | None = None):
    """A copy of the set-up script and the requirements files, and an nvidia-smi on PATH that lists
    one GPU with this driver and compute capability (None: a driver too old to report it). `stack`:
    a .venv installed from that requirements file already, whose python is this one (CPU torch)."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "setup.sh"), repo / "scripts")
    for req in ("requirements.txt", "requirements-cpu.txt"):
        shutil.copy(os.path.join(REPO, req), repo)
    if stack:
        digest = subprocess.run(["sha256sum", repo / stack], capture_output=True, text=True)
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / f".installed-{digest.stdout[:16]}").touch()
        (repo / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        (repo / ".venv" / "bin" / "python").chmod(0o755)
    answers = {"name": "Tesla T4", "driver_version": driver, "compute_cap": cap}
    cases = "".join(
        f"  *--query-gpu={k}*) {'echo ' + repr(v) if v else 'echo Field is not valid >&2; exit 2'} ;;\n"
        for k, v in answers.items()
    )
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n  -L) echo "GPU 0: Tesla T4" ;;\n{cases}esac\n')
    smi.chmod(0o755)
    return repo, dict(os.environ, PATH=f"{smi.parent}:{os.environ['PATH']}")


@pytest.mark.parametrize(
    "driver,cap,stack,cpu,error",
    [("535.104.05", "7.5", None, False, r"the NVIDIA driver here is 535\.104\.05; the pinned CUDA 13 "
      r"build of torch and vLLM needs 580 or newer: update the driver, or use the CPU stack: "
      r"POSTTRAIN_CPU=1 make demo \(or make test\)"),
     ("470.82.01", None, None, False, r"the NVIDIA driver here is 470\.82\.01; .* needs 580"),
     ("590.48.01", "7.0", None, False, r"the Tesla T4 \(compute capability 7\.0\) is older than the "
      r"pinned CUDA 13 build of torch and vLLM supports .*POSTTRAIN_CPU=1 make demo"),
     ("590.48.01", "7.5", "requirements.txt", False, r"torch 2\.13\.0\S* sees no GPU although "
      r"nvidia-smi lists the Tesla T4 \(driver 590\.48\.01; the pinned CUDA 13 build needs 580 or "
      r"newer\): check the driver and CUDA_VISIBLE_DEVICES, or use the CPU stack"),
     ("535.104.05", "7.5", "requirements-cpu.txt", True, None)],
    ids=["old-driver", "driver-without-compute-cap", "v100-class-gpu", "torch-sees-no-gpu",
         "cpu-stack-on-request"],
)  # fmt: skip
def test_setup_stops_in_one_line_where_the_cuda_build_cannot_run(
    tmp_path, driver, cap, stack, cpu, error
):
    """scripts/setup.sh on a GPU machine the pinned CUDA 13 build cannot use: a driver older than
    580 (also one too old to report the compute capability), a GPU below compute capability 7.5,
    or an installed CUDA stack whose torch sees no GPU: one line naming what was found, what is
    needed, and POSTTRAIN_CPU=1; nothing installed. With POSTTRAIN_CPU=1 it takes the CPU stack
    (here already installed: nothing to do)."""
    repo, env = fake_repo_with_gpu(tmp_path, driver, cap, stack)
    env |= {"POSTTRAIN_CPU": "1"} if cpu else {}
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    if error is None:
        assert out.returncode == 0 and out.stdout == out.stderr == "", out.stderr
        return
    assert out.returncode == 1 and out.stdout == "", out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(f"error: {error}.*", lines[0]), lines
    if stack:  # installed before: left as it was (the check runs again next time)
        assert len([f for f in os.listdir(repo / ".venv") if f.startswith(".installed-")]) == 1
    else:  # nothing installed
        assert not (repo / ".venv").exists()
