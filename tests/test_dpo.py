"""dpo.py: DPO / cDPO / IPO losses, summed response logprobs, FSDP2 across ranks, end-to-end runs
(bad input: test_bad_input.py)."""

import math
import os

import pytest
import torch
from conftest import (
    assert_same_training,
    only_run_dir,
    read_jsonl,
    run_script,
    train_with_ranks,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import dpo
from common.data import encode_example, load_rows


def softplus(x):  # -log σ(-x) = log(1 + e^x)
    return math.log(1 + math.exp(x))


def test_losses_closed_form():
    # hand-made sequence logprobs of two pairs: policy and reference, chosen and rejected
    pi_c, pi_r = torch.tensor([-3.0, -5.0]), torch.tensor([-6.0, -4.0])
    ref_c, ref_r = torch.tensor([-4.0, -5.0]), torch.tensor([-5.0, -4.5])
    chosen, rejected = pi_c - ref_c, pi_r - ref_r  # Δ_c = [1, 0], Δ_r = [-1, 0.5] -> h = [2, -0.5]
    beta = 0.5
    dpo_want = torch.tensor([softplus(-1.0), softplus(0.25)])  # -log σ(β h) = log(1 + e^(-β h))
    torch.testing.assert_close(dpo.compute_dpo_loss(chosen, rejected, beta), dpo_want)
    eps = 0.2
    cdpo_want = torch.tensor(
        [0.8 * softplus(-1.0) + 0.2 * softplus(1.0), 0.8 * softplus(0.25) + 0.2 * softplus(-0.25)]
    )
    torch.testing.assert_close(
        dpo.compute_dpo_loss(chosen, rejected, beta, label_smoothing=eps), cdpo_want
    )
    ipo_want = torch.tensor([(2 - 1.0) ** 2, (-0.5 - 1.0) ** 2])  # (h - 1/(2β))², 1/(2β) = 1
    torch.testing.assert_close(dpo.compute_dpo_loss(chosen, rejected, beta, ipo=True), ipo_want)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.zeros(3, requires_grad=True)
    rejected = torch.zeros(3, requires_grad=True)
    dpo.compute_dpo_loss(chosen, rejected, beta=0.1).sum().backward()
    assert (chosen.grad < 0).all() and (
        rejected.grad > 0
    ).all()  # gradient descent raises Δ_c, lowers Δ_r
    torch.testing.assert_close(chosen.grad, torch.full((3,), -0.05))  # -β σ(0) = -0.05


def test_sequence_logprobs_sum_response_tokens_only(tiny_model, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    examples = [
        encode_example(tokenizer, prompt, [{"role": "assistant", "content": text}])
        for text in ("2 + 3 = 5", "2 + 3 = 23", "5", "The sum of 2 and 3 is 6.")
    ]
    units = [dpo.make_pair(examples[0], examples[1]), dpo.make_pair(examples[2], examples[3])]
    mb = {
        k: torch.tensor([units[0][k] + units[1][k]]) for k in units[0]
    }  # two pairs packed in one row
    mb["seq_index"], mb["num_seqs"] = (
        (mb["positions"] == 0).cumsum(1) - 1,
        torch.tensor(4),
    )  # as pair_losses does
    with torch.no_grad():
        got = dpo.sequence_logprobs(model, mb)
        want = []
        for (
            ids,
            mask,
        ) in examples:  # each response alone: explicit log-softmax, summed over response tokens
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            want.append(sum(logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]))
    assert got.shape == (2, 2)
    torch.testing.assert_close(got, torch.stack(want).view(2, 2), atol=1e-4, rtol=0)


def train(world_size, model_path, tokenizer, out_dir, sp_size=1):
    rows, _ = load_rows("data/arithmetic/prefs_train.jsonl")
    pairs = [
        dpo.make_pair(encode_example(tokenizer, r["prompt"], r["chosen"]), encode_example(tokenizer, r["prompt"], r["rejected"]))
        for r in rows[:24]
    ]  # fmt: skip
    args = dpo.Args(learning_rate=1e-3, warmup_steps=1, num_steps=3, max_tokens_per_micro_batch=256, beta=0.5,
                    sp_size=sp_size, num_trainers=world_size)  # fmt: skip
    return train_with_ranks(dpo, args, pairs, model_path, out_dir, per_group=True)


@pytest.fixture(scope="module")
def one_rank(tiny_model, tokenizer, tmp_path_factory):
    """The one-rank run the two-rank runs are compared with, trained once."""
    return train(1, tiny_model, tokenizer, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("sp_size", [1, 2], ids=["dp2", "sp2"])
def test_two_ranks_match_one_rank(one_rank, tiny_model, tokenizer, tmp_path, sp_size):
    # sp2: both ranks split every row with ring attention; sequence sums are all-reduced over the
    # pair of ranks
    losses1, weights1 = one_rank
    losses2, weights2 = train(2, tiny_model, tokenizer, tmp_path / "two", sp_size)
    assert losses1[0] == pytest.approx(
        math.log(2), abs=1e-5
    )  # policy = reference at step 0: -log σ(0)
    assert losses1 == pytest.approx(losses2, abs=1e-4)
    assert_same_training(
        weights1, weights2, load_file(os.path.join(tiny_model, "model.safetensors"))
    )


def test_dpo_end_to_end_loads_in_transformers(tiny_model, tmp_path):
    out = tmp_path / "runs"
    result = run_script(
        "dpo.py", "--model", tiny_model, "--output-dir", str(out), "--num-steps", "3", "--batch-size", "4",
        "--learning-rate", "1e-3", "--warmup-steps", "1", "--max-new-tokens", "4", "--label-smoothing", "0.1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/accuracy"] == pytest.approx(
        0.5, abs=0.1
    )  # policy = reference: ties count half
    assert rows[0]["eval/margin"] == pytest.approx(0.0, abs=1e-3)
    want = {
        "eval/loss",
        "eval/accuracy",
        "eval/margin",
        "eval/chosen_reward",
        "eval/greedy_accuracy",
    }
    assert want <= rows[-1].keys() and {"train/loss", "train/rejected_reward"} <= rows[1].keys()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "final"))
    assert model.config.num_hidden_layers == 2
    assert (
        len(read_jsonl(os.path.join(run_dir, "samples.jsonl"))) == 2 * 64
    )  # greedy samples at steps 0 and 3


def test_compute_loss_from_sequence_logprobs():
    args = dpo.Args(beta=0.5)
    logprobs = torch.tensor([[-3.0, -6.0], [-5.0, -4.0]])  # (P, 2): chosen, rejected under π_θ
    ref = torch.tensor([[-4.0, -5.0], [-5.0, -4.5]])  # Δ_c = [1, 0], Δ_r = [-1, 0.5]: h = [2, -0.5]
    losses, rewards = dpo.compute_loss(logprobs, ref, args)
    torch.testing.assert_close(losses, torch.tensor([softplus(-1.0), softplus(0.25)]))
    torch.testing.assert_close(rewards, 0.5 * (logprobs - ref))
    assert not rewards.requires_grad


def test_every_pair_stat_is_logged_as_its_mean_per_pair():
    """pair_metrics: each stat pair_stats returns (a variant's new one too) is <prefix>/<name>, its
    mean over the pairs of every data-parallel rank (an SP group's ranks counted once); the
    update's grad norm and lr are not pair stats."""
    ranks = [{"loss": 1.0, "accuracy": 2.0, "my_stat": 3.0, "pairs": 4, "grad_norm": 9.0, "lr": 1.0},
             {"loss": 3.0, "accuracy": 0.0, "my_stat": 1.0, "pairs": 4, "grad_norm": 9.0, "lr": 1.0}]  # fmt: skip
    assert dpo.pair_metrics("train", ranks, dpo.Args()) == {
        "train/loss": 0.5, "train/accuracy": 0.25, "train/my_stat": 0.5}  # fmt: skip
    assert dpo.pair_metrics("eval", ranks, dpo.Args(sp_size=2, num_trainers=2)) == {
        "eval/loss": 0.25, "eval/accuracy": 0.5, "eval/my_stat": 0.75}  # fmt: skip
