"""rm.py: the Bradley-Terry loss, where the reward is read, FSDP2 across ranks, end-to-end runs (bad
input: test_bad_input.py)."""

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
from transformers import AutoModelForSequenceClassification

import rm
from common.data import encode_example, load_rows


def test_rm_loss_closed_form():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    margins = torch.tensor([0.0, 0.0, 0.5])
    got = rm.compute_rm_loss(chosen, rejected, margins)
    # -log σ(x) = log(1 + e^-x) with x = r_c - r_r - m = 1, 0, -2.5
    want = torch.tensor([math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.exp(2.5))])
    torch.testing.assert_close(got, want)


def test_sequence_ends_left_right_and_packed():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    for mask, want in ((right, [2, 4]), (left, [4, 4])):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ends = rm.sequence_ends(mask, pos)
        assert ends.sum(-1).tolist() == [1, 1]  # exactly one end per row
        assert ends.int().argmax(-1).tolist() == want
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three sequences in one row
    assert rm.sequence_ends(torch.ones_like(packed), packed).nonzero()[:, 1].tolist() == [2, 4, 8]


@pytest.fixture(scope="module")
def reward_model(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model, num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def test_reward_is_read_at_the_last_real_token(reward_model, tokenizer):
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    a = encode_example(tokenizer, prompt, [{"role": "assistant", "content": "2 + 3 = 5"}])[0]
    b = encode_example(
        tokenizer, prompt, [{"role": "assistant", "content": "The sum of 2 and 3 is 6, I think."}]
    )[0]
    with torch.no_grad():
        # each sequence alone: the head's output at its last token (the hidden state of the whole
        # sequence)
        alone = [
            reward_model.score(reward_model.model(torch.tensor([x])).last_hidden_state)[0, -1, 0]
            for x in (a, b)
        ]
        alone = torch.stack(alone)
        width, pad = max(len(a), len(b)), tokenizer.pad_token_id
        for side in ("left", "right"):
            rows = [
                [pad] * (width - len(x)) + x if side == "left" else x + [pad] * (width - len(x))
                for x in (a, b)
            ]
            masks = [[0] * (width - len(x)) + [1] * len(x) if side == "left" else [1] * len(x) + [0] * (width - len(x))
                     for x in (a, b)]  # fmt: skip
            mask = torch.tensor(masks)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            got = rm.compute_rewards(reward_model, torch.tensor(rows), pos, mask)
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
        packed = rm.compute_rewards(
            reward_model,
            torch.tensor([a + b]),
            torch.tensor([list(range(len(a))) + list(range(len(b)))]),
        )
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert (alone[0] - alone[1]).abs() > 1e-4  # the two sequences really score differently


def train(world_size, model_path, tokenizer, out_dir, sp_size=1):
    rows, _ = load_rows("data/arithmetic/prefs_train.jsonl")
    pairs = []
    for r in rows[:24]:
        c, _ = encode_example(tokenizer, r["prompt"], r["chosen"])
        j, _ = encode_example(tokenizer, r["prompt"], r["rejected"])
        pairs.append(rm.make_pair(c, j, 0.5))
    args = rm.Args(learning_rate=1e-3, warmup_steps=1, num_steps=3, max_tokens_per_micro_batch=256,
                   sp_size=sp_size, num_trainers=world_size)  # fmt: skip
    return train_with_ranks(rm, args, pairs, model_path, out_dir, per_group=True)


@pytest.fixture(scope="module")
def one_rank(tiny_model, tokenizer, tmp_path_factory):
    """The one-rank run the two-rank runs are compared with, trained once."""
    return train(1, tiny_model, tokenizer, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("sp_size", [1, 2], ids=["dp2", "sp2"])
def test_two_ranks_match_one_rank(one_rank, tiny_model, tokenizer, tmp_path, sp_size):
    # sp2: both ranks split every row with ring attention; each reward is read on the rank holding
    # its end token
    losses1, weights1 = one_rank
    losses2, weights2 = train(2, tiny_model, tokenizer, tmp_path / "two", sp_size)
    assert losses1 == pytest.approx(losses2, abs=1e-4)
    assert_same_training(
        weights1, weights2, load_file(os.path.join(tiny_model, "model.safetensors"))
    )
    assert "score.weight" in weights1


def test_rm_end_to_end_loads_in_transformers(tiny_model, tokenizer, tmp_path):
    out = tmp_path / "runs"
    result = run_script(
        "rm.py", "--model", tiny_model, "--output-dir", str(out), "--num-steps", "3", "--batch-size", "4",
        "--learning-rate", "1e-3", "--warmup-steps", "1", "--eval-every", "2", "--save-every", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {"eval/accuracy", "eval/margin", "eval/loss"} <= rows[
        -1
    ].keys() and "train/loss" in rows[1]
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_2", "trainer_state.pt"))
    model = AutoModelForSequenceClassification.from_pretrained(
        os.path.join(run_dir, "checkpoints", "final")
    )
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    ids, _ = encode_example(tokenizer, [{"role": "user", "content": "What is 1 + 2?"}], "1 + 2 = 3")
    with torch.no_grad():
        logits = model(torch.tensor([ids, ids])).logits
    assert logits.shape == (2, 1) and torch.isfinite(logits).all()


def test_compute_loss_sums_pairs_and_counts():
    chosen, rejected, margins = (
        torch.tensor([2.0, -1.0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.5]),
    )
    loss, stats = rm.compute_loss(chosen, rejected, margins)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2.5)))
    assert stats["accuracy"].item() == 1 and stats["margin"].item() == pytest.approx(1.0 - 2.0)
