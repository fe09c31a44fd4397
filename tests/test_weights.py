"""The weights' own flags: the EMA of the policy (--ema-beta, --eval-ema) and the best checkpoint
(--best-metric, --best-mode). Muon is in test_optim.py, IcePop in test_grpo.py, bad input in
test_bad_input.py."""

import json
import os

import pytest
import torch
from conftest import only_run_dir, read_jsonl, run_script, trainer_rank
from safetensors.torch import load_file

import sft
from common.data import split_for_ranks
from common.optim import ema_swap


def weights(folder) -> dict:
    return load_file(os.path.join(folder, "model.safetensors"))


def test_ema_is_the_closed_form_and_swaps_back_exactly(one_rank_group, tiny_model):
    """After k optimizer steps θ_ema = β^k θ_0 + (1-β) Σ_j β^(k-j) θ_j (θ_j: the weights after step
    j); swapping θ and θ_ema twice leaves both exactly as they were (an --eval-ema evaluation
    cannot change the training)."""
    addr, port = one_rank_group
    args = sft.Args(learning_rate=1e-2, warmup_steps=0, ema_beta=0.6)
    trainer = trainer_rank(sft, args, tiny_model, addr, port)
    params = lambda: [p.detach().to_local().clone() for p in trainer.model.parameters()]  # noqa: E731
    thetas = [params()]
    seq = sft.make_sequence([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1])
    for step in range(3):
        sft.train_step(trainer, split_for_ranks([seq], 1, 64)[0], 4, step)
        thetas.append(params())
    beta = 0.6
    for i, ema in enumerate(trainer.ema):
        want = beta**3 * thetas[0][i].double()
        for j in (1, 2, 3):
            want += (1 - beta) * beta ** (3 - j) * thetas[j][i].double()
        torch.testing.assert_close(ema.double(), want, atol=1e-6, rtol=0)
    assert max((t - s).abs().max() for t, s in zip(thetas[3], thetas[0])) > 1e-3  # it trained
    ema = [e.clone() for e in trainer.ema]
    ema_swap(trainer)
    assert all(torch.equal(p, e) for p, e in zip(params(), ema))
    assert all(torch.equal(e, t) for e, t in zip(trainer.ema, thetas[3]))
    ema_swap(trainer)
    assert all(torch.equal(p, t) for p, t in zip(params(), thetas[3]))
    assert all(torch.equal(e, f) for e, f in zip(trainer.ema, ema))


def sft_flags(model, out, *extra):
    return ("--model", model, "--output-dir", str(out), "--num-trainers", "2", "--batch-size", "4",
            "--learning-rate", "1e-3", "--warmup-steps", "1", "--accuracy-dataset", "",
            "--num-steps", "3", "--eval-every", "1", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def ema_run(tiny_model, tmp_path_factory):
    """sft.py on 2 FSDP2 ranks (the EMA sharded with the weights), θ_ema evaluated and ranked; Muon
    steps the weights (its state goes through the checkpoint and --resume)."""
    out = tmp_path_factory.mktemp("ema")
    flags = ("--ema-beta", "0.5", "--eval-ema", "--save-every", "1", "--optimizer", "muon")
    flags += ("--best-metric", "eval/loss", "--best-mode", "min")
    result = run_script("sft.py", *sft_flags(tiny_model, out, *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, only_run_dir(out), flags, result.stdout


def test_ema_checkpoints_hold_the_closed_form_on_two_ranks(ema_run, tiny_model):
    """Every checkpoint's ema/ is an HF folder holding θ_ema_k = β θ_ema_k-1 + (1-β) θ_k, θ_ema_0
    the start model, θ_k the checkpoint's own weights (gathered from 2 shards, each averaged where
    it lives)."""
    _, run_dir, _, _ = ema_run
    ckpt = lambda name: os.path.join(run_dir, "checkpoints", name)  # noqa: E731
    ema = {k: v.double() for k, v in weights(tiny_model).items()}
    for name in ("step_1", "step_2", "final"):
        theta = weights(ckpt(name))
        ema = {k: 0.5 * v + 0.5 * theta[k].double() for k, v in ema.items()}
        saved = weights(os.path.join(ckpt(name), "ema"))
        assert saved.keys() == theta.keys()
        for key, value in saved.items():
            torch.testing.assert_close(value.double(), ema[key], atol=1e-6, rtol=0, msg=key)
    assert os.path.isfile(os.path.join(ckpt("final"), "ema", "config.json"))
    assert os.path.isfile(os.path.join(ckpt("final"), "ema", "tokenizer_config.json"))


def test_eval_ema_evaluates_the_average(ema_run, tiny_model, tmp_path):
    """With --eval-ema, step k's eval/loss is θ_ema's: a run started from step_2/ema (no EMA)
    logs the same loss before its first step."""
    _, run_dir, _, _ = ema_run
    logged = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    start = os.path.join(run_dir, "checkpoints", "step_2", "ema")
    result = run_script(
        "sft.py", *sft_flags(start, tmp_path, "--num-steps", "1", "--no-save-final")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = read_jsonl(os.path.join(only_run_dir(tmp_path), "metrics.jsonl"))[0]
    assert first["step"] == 0
    assert first["eval/loss"] == pytest.approx(logged[2]["eval/loss"], rel=1e-6)
    assert logged[2]["eval/loss"] != logged[1]["eval/loss"]


def test_best_checkpoint_is_the_best_evaluation_whole_and_alone(ema_run):
    """checkpoints/best holds the weights (and ema/) of the step with the lowest eval/loss, its
    step, metric and value in checkpoint.json; one folder, nothing half-written beside it."""
    _, run_dir, _, stdout = ema_run
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > 0]
    best_row = min(rows, key=lambda r: r["eval/loss"])  # min() keeps the first of a tie
    folder = os.path.join(run_dir, "checkpoints")
    with open(os.path.join(folder, "best", "checkpoint.json")) as f:
        info = json.load(f)
    assert info == {"step": best_row["step"], "metric": "eval/loss", "value": best_row["eval/loss"]}
    same = "final" if best_row["step"] == 3 else f"step_{best_row['step']}"
    for sub in ("", "ema"):
        got, want = (
            weights(os.path.join(folder, "best", sub)),
            weights(os.path.join(folder, same, sub)),
        )
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not os.path.exists(os.path.join(folder, "best", "trainer_state.pt"))  # weights only
    assert sorted(os.listdir(folder)) == ["best", "final", "step_1", "step_2"]
    assert f"best: eval/loss {best_row['eval/loss']:.4g} at step {best_row['step']}" in stdout


def test_resume_restores_the_ema_exactly(ema_run):
    """--resume from step_1: the steps after it log what the run logged (θ_ema's evaluations
    included; Muon's momentum restored), the best checkpoint is the same, and the final θ_ema is
    the same to the bit."""
    _, run_dir, _, _ = ema_run
    path = lambda *p: os.path.join(run_dir, *p)  # noqa: E731
    final_ema, best = (
        weights(path("checkpoints", "final", "ema")),
        weights(path("checkpoints", "best")),
    )
    before = read_jsonl(path("metrics.jsonl"))
    with open(path("config.json")) as f:
        argv = json.load(f)["argv"][1:]
    result = run_script("sft.py", *argv, "--resume", path("checkpoints", "step_1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume: from" in result.stdout and "step 1 of 3" in result.stdout
    after = read_jsonl(path("metrics.jsonl"))
    assert [r["step"] for r in after] == [r["step"] for r in before]
    for old, new in zip(before, after):
        for key, value in old.items():
            if not key.startswith(("time/", "perf/")):
                assert new[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (old["step"], key)
    again = weights(path("checkpoints", "final", "ema"))
    assert all(torch.equal(again[k], final_ema[k]) for k in final_ema)
    assert all(torch.equal(v, best[k]) for k, v in weights(path("checkpoints", "best")).items())


@pytest.mark.cpu_engine("fp32 engines: the trainer-engine checks are exact on CPU only")
def test_rl_weights_flags_on_the_engines(grpo_run):
    """grpo.py with every flag of the family (conftest's grpo_run): --eval-ema pushes θ_ema to the
    engines for each evaluation (the probe after the push checks they serve it) and θ back (the
    next step samples from θ: logprob_diff_max stays at float noise); IcePop masks nothing in fp32;
    Muon steps; checkpoints/best holds the step with the best eval/accuracy (the first of a tie)."""
    _, run_dir, _ = grpo_run
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/icepop_masked"] == 0 and r["train/grad_norm"] > 0 for r in rows[1:])
    assert rows[2]["train/logprob_diff_max"] < 1e-4  # after step 1's EMA evaluation: θ again
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)["args"]
    assert (config["optimizer"], config["ema_beta"], config["eval_ema"]) == ("muon", 0.5, True)
    with open(os.path.join(run_dir, "checkpoints", "best", "checkpoint.json")) as f:
        best = json.load(f)
    best_row = max(rows[1:], key=lambda r: r["eval/accuracy"])  # max() keeps the first of a tie
    assert best == {"step": best_row["step"], "metric": "eval/accuracy",
                    "value": best_row["eval/accuracy"]}  # fmt: skip
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "best", "ema", "model.safetensors"))
