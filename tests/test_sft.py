"""sft.py: its math, FSDP2 across ranks, the greedy generate/accuracy path sft.py and dpo.py share,
and end-to-end runs (checkpoint, resume); bad input is in test_bad_input.py."""

import math
import os

import pytest
import ray
import torch
from conftest import (
    assert_same_training,
    only_run_dir,
    read_jsonl,
    run_script,
    train_with_ranks,
)
from safetensors.torch import load_file
from standins import Echo
from transformers import AutoModelForCausalLM

import sft
from common import greedy
from common.data import encode_example, encode_prompt, load_rows


def test_compute_logprobs_matches_full_log_softmax(tiny_model, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    a, ma = encode_example(
        tokenizer,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    )
    b, mb = encode_example(
        tokenizer, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    )
    # packed: two sequences in one row, positions restarting; the block mask must keep them apart
    seqs = [sft.make_sequence(a, ma), sft.make_sequence(b, mb)]
    ids = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    labels = torch.tensor([seqs[0]["labels"] + seqs[1]["labels"]])
    mask = torch.tensor([seqs[0]["loss_mask"] + seqs[1]["loss_mask"]])
    got = sft.compute_logprobs(model, ids, pos, labels, mask, temperature=0.7)
    want = []
    for x, m in ((a, ma), (b, mb)):  # each sequence alone, full logits, explicit log-softmax
        logits = model(torch.tensor([x])).logits[0] / 0.7
        logp = torch.log_softmax(logits, -1)
        want += [logp[t - 1, x[t]] for t in range(1, len(x)) if m[t]]
    assert got.shape == (sum(ma) + sum(mb),)
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=0)


def test_reward_fn():
    assert sft.reward_fn("3 + 4 = 7", "7") == 1.0
    assert sft.reward_fn("7 is 3 + 4", "7") == 0.0  # the last number counts
    assert sft.reward_fn("The answer is 1,234.", "#### 1234") == 1.0
    assert sft.reward_fn("no number", "7") == 0.0
    assert sft.reward_fn(r"so $\frac{1}{2}$", r"\frac{1}{2}") == 1.0


def test_lr_schedule():
    from common.trainer import lr_at  # the shell sets it before each optimizer step

    lrs = [lr_at(s, 1.0, warmup_steps=2, num_steps=10, min_lr_ratio=0.1) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0]
    assert all(x > y for x, y in zip(lrs[1:], lrs[2:]))  # cosine decay is strictly decreasing
    assert lrs[-1] == pytest.approx(0.1)  # the last step runs at the floor


def test_batch_rows_is_a_function_of_the_step():
    epoch = [r for s in range(4) for r in sft.batch_rows(s, 12, 3, seed=5)]
    assert sorted(epoch) == list(range(12))  # one epoch visits every row once
    assert sft.batch_rows(2, 12, 3, seed=5) == sft.batch_rows(2, 12, 3, seed=5)
    assert epoch != [r for s in range(4) for r in sft.batch_rows(s, 12, 3, seed=6)]


def train(world_size, model_path, tokenizer, out_dir, sp_size=1):
    rows, _ = load_rows("data/arithmetic/sft_train.jsonl")
    sequences = [sft.make_sequence(*encode_example(tokenizer, r["messages"])) for r in rows[:24]]
    args = sft.Args(learning_rate=1e-3, warmup_steps=1, num_steps=3, max_tokens_per_micro_batch=128,
                    sp_size=sp_size, num_trainers=world_size)  # fmt: skip
    count = lambda batch: sum(sum(s["loss_mask"]) for s in batch)  # noqa: E731  (tokens)
    return train_with_ranks(sft, args, sequences, model_path, out_dir, count)


@pytest.fixture(scope="module")
def one_rank(tiny_model, tokenizer, tmp_path_factory):
    """The one-rank run the two-rank runs are compared with, trained once."""
    return train(1, tiny_model, tokenizer, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("sp_size", [1, 2], ids=["dp2", "sp2"])
def test_two_ranks_match_one_rank(one_rank, tiny_model, tokenizer, tmp_path, sp_size):
    # dp2: FSDP2 data parallel over 2 ranks; sp2: both ranks split every row with ring attention
    # (--sp-size 2)
    losses1, weights1 = one_rank
    losses2, weights2 = train(2, tiny_model, tokenizer, tmp_path / "two", sp_size)
    assert losses1[-1] < losses1[0]  # it learns (lr 1e-3 on a tiny model)
    assert losses1 == pytest.approx(losses2, abs=1e-4)
    assert_same_training(
        weights1, weights2, load_file(os.path.join(tiny_model, "model.safetensors"))
    )


def sft_args(model, out, *extra):
    return ("--model", model, "--output-dir", str(out), "--max-tokens-per-micro-batch", "512", "--batch-size", "4",
            "--learning-rate", "1e-3", "--warmup-steps", "1", "--max-new-tokens", "4", *extra)  # fmt: skip


def test_sft_end_to_end_checkpoint_and_resume(tiny_model, tmp_path):
    full = run_script(
        "sft.py", *sft_args(tiny_model, tmp_path / "full", "--num-steps", "3", "--save-every", "2")
    )
    assert full.returncode == 0, full.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "full")
    final = os.path.join(run_dir, "checkpoints", "final")
    model = AutoModelForCausalLM.from_pretrained(final)  # loads as a plain HF model
    assert model.config.num_hidden_layers == 2
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1] and "eval/loss" in rows[-1]
    assert os.path.isfile(os.path.join(run_dir, "config.json"))

    # resume from step 2: the third step sees the same data and optimizer state, so it logs the same
    # loss; with --no-save-final the final model of the first run stays as it was
    ckpt = os.path.join(run_dir, "checkpoints", "step_2")
    saved = os.stat(os.path.join(final, "config.json"))
    flags = ("--resume", ckpt, "--no-save-final")  # --num-steps and --save-every: the run's
    resumed = run_script("sft.py", *sft_args(tiny_model, tmp_path / "full", *flags))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: keeps the run's own --num-steps 3, --save-every 2" in resumed.stdout
    assert "resume: changes --no-save-final (was --save-final)" in resumed.stdout
    kept = os.stat(os.path.join(final, "config.json"))
    assert (kept.st_ino, kept.st_mtime_ns) == (saved.st_ino, saved.st_mtime_ns)
    assert "final model:" not in resumed.stdout
    rows2 = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows2] == [0, 1, 2, 3]
    assert rows2[-1]["train/loss"] == pytest.approx(rows[-1]["train/loss"], abs=1e-4)
    assert rows2[-1]["train/loss"] != pytest.approx(rows[1]["train/loss"], abs=1e-4)


def test_compute_loss_is_the_summed_nll():
    assert sft.compute_loss(torch.log(torch.tensor([0.5, 0.25]))).item() == pytest.approx(
        math.log(8)
    )


def test_greedy_completions_batch_like_one_at_a_time(tiny_model, tokenizer):
    """Prompts of different lengths, left-padded into one batch, get the completions each gets
    alone: the padding is masked and every prompt ends where generation starts; EOS and padding are
    cut."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    questions = ["1 + 1?", "What is 12 + 30? Think step by step.", "Hi"]
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == 3
    batched = greedy.greedy_completions(model, tokenizer, prompts, 6, synced=False)
    for prompt, got in zip(prompts, batched):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        alone = [t for t in out[0, len(prompt) :].tolist() if t != tokenizer.eos_token_id]
        assert got == alone and 0 < len(got) <= 6


def test_greedy_accuracy_puts_each_completion_back_with_its_row(ray_cpu, tokenizer):
    """Prompts dealt round-robin to 3 ranks come back in row order, scored against their own
    answer."""
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(7)]
    rows = [{"prompt": f"q{d}", "answer": d if d % 3 else d + 1} for d in range(7)]  # 4 of 7 right
    trainers = [Echo.remote() for _ in range(3)]
    prompts = [[5, d] for d in digits]
    accuracy, samples = greedy.accuracy(trainers, rows, prompts, tokenizer, 1, sft.reward_fn)
    assert [s["response"] for s in samples] == [str(d) for d in range(7)]
    assert [s["prompt"] for s in samples] == [r["prompt"] for r in rows]
    assert accuracy == pytest.approx(4 / 7) and [s["reward"] for s in samples] == [
        0,
        1,
        1,
        0,
        1,
        1,
        0,
    ]
    for t in trainers:
        ray.kill(t)
