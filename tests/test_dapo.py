"""dapo.py: the diff against grpo.py stays small and tagged; dynamic sampling, the asymmetric clip,
token-level weights and the overlong penalty against hand-computed values; a 2-step end-to-end
run."""

import math
import os
import random
import re

import pytest
import torch
from conftest import REPO, assert_resume_is_exact, only_run_dir, read_jsonl, run_script, tagged_diff

import dapo

SECTIONS = {
    "clip-higher",
    "dynamic-sampling",
    "token-level-loss",
    "overlong-filtering",
    "overlong-punishment",
    "no-kl",
}
TAG = re.compile(r"# DAPO \(([a-z-]+)\)")


def test_diff_to_grpo_is_small_and_every_hunk_is_tagged():
    changed, untagged, sections = tagged_diff("grpo.py", "dapo.py", TAG)
    assert 0 < changed <= 120, f"dapo.py changes {changed} lines of grpo.py (budget 120)"
    assert sections <= SECTIONS, f"unknown DAPO section(s) {sections - SECTIONS}"
    assert not untagged, f"hunks without a `# DAPO (<section>)` tag near dapo.py lines {untagged}"
    with open(os.path.join(REPO, "dapo.py")) as f:
        assert set(TAG.findall(f.read())) == SECTIONS  # every DAPO change is there


def test_grpo_only_fields_are_gone():
    fields = dapo.Args.__dataclass_fields__
    assert "kl_coef" not in fields and "clip_eps" not in fields
    assert (fields["clip_eps_low"].default, fields["clip_eps_high"].default) == (0.2, 0.28)
    assert not hasattr(dapo, "compute_kl")


def test_keep_groups_drops_all_equal_groups():
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, -0.25, 1.0, 1.0]
    )  # 4 groups of 3
    assert dapo.keep_groups(rewards, 3).tolist() == [False, True, False, True]


def scripted_draw(rounds_of_rewards, group_size, penalty=None):
    """A stand-in for vLLM + reward: round k returns the k-th list of groups (one tuple of verifier
    scores per group); the rewards are the scores plus `penalty(k, i, j)` (the overlong punishment),
    0 by default."""
    calls = []

    def draw(k):
        calls.append(k)
        groups = rounds_of_rewards[k]
        scores = torch.tensor([float(r) for g in groups for r in g])
        extra = torch.tensor(
            [
                penalty(k, i, j) if penalty else 0.0
                for i, g in enumerate(groups)
                for j in range(len(g))
            ]
        )
        return [("round", k, i) for i in range(len(groups))], scores + extra, scores

    return draw, calls


def test_dynamic_sampling_refills_and_stops_when_full():
    # 3 groups per round, G = 2; 2 informative groups are wanted.
    rounds = [[(1, 1), (0, 1), (0, 0)], [(1, 1), (1, 0), (0, 1)], [(0, 1), (0, 1), (0, 1)]]
    draw, calls = scripted_draw(rounds, 2)
    rounds, rewards, kept, used = dapo.sample_groups(draw, num_groups=2, group_size=2, max_rounds=5)
    groups = sum(rounds, [])  # every round's groups, in order
    assert calls == [0, 1] and used == 2  # the second round filled the batch; no third round
    assert len(groups) == 6 and rewards.shape == (12,) and kept.shape == (6,)
    assert kept.tolist() == [
        False,
        True,
        False,
        False,
        True,
        False,
    ]  # the 3rd informative group is not needed
    assert [groups[i] for i in kept.nonzero().squeeze(-1).tolist()] == [
        ("round", 0, 1),
        ("round", 1, 1),
    ]


def test_dynamic_sampling_stops_at_the_cap():
    rounds = [[(1, 1), (0, 0)], [(0, 0), (1, 0)], [(1, 1), (1, 1)], [(0, 1), (0, 1)]]
    draw, calls = scripted_draw(rounds, 2)
    _, rewards, kept, used = dapo.sample_groups(draw, num_groups=2, group_size=2, max_rounds=3)
    assert (
        calls == [0, 1, 2] and used == 3
    )  # the cap, although the 4th round would have filled the batch
    assert kept.tolist() == [
        False,
        False,
        False,
        True,
        False,
        False,
    ]  # train on what was collected: 1 group
    draw, calls = scripted_draw([[(1, 1)]] * 4, 2)
    _, _, kept, used = dapo.sample_groups(draw, num_groups=1, group_size=2, max_rounds=4)
    assert (
        calls == [0, 1, 2, 3] and used == 4 and not kept.any()
    )  # nothing informative: nothing to train


def test_dynamic_sampling_never_keeps_an_all_equal_group():
    rng = random.Random(0)
    for _ in range(200):
        G, want, cap = rng.choice([2, 4, 8]), rng.randint(1, 6), rng.randint(1, 4)
        rounds = [[tuple(rng.choice([0.0, 1.0]) if rng.random() < 0.5 else 1.0 for _ in range(G)) for _ in range(6)]
                  for _ in range(cap)]  # fmt: skip
        draw, calls = scripted_draw(rounds, G)
        rounds, rewards, kept, used = dapo.sample_groups(draw, want, G, cap)
        groups = sum(rounds, [])
        grouped = rewards.view(-1, G)
        assert used == len(calls) <= cap and len(groups) == len(kept) == grouped.shape[0]
        assert kept.sum() <= want
        for g in kept.nonzero().squeeze(-1).tolist():
            assert grouped[g].max() > grouped[g].min()  # never an all-equal group
        informative = int((grouped.max(dim=1).values > grouped.min(dim=1).values).sum())
        assert kept.sum() == min(
            want, informative
        )  # every informative group is used until the batch is full
        assert (used == cap) or kept.sum() == want  # it stops early only with a full batch


def test_groups_are_kept_on_accuracy_not_on_the_length_penalty():
    """DAPO §3.2 keeps a group when 0 < #correct < G. Four correct answers of different lengths have
    different rewards (the overlong penalty) but nothing to learn about correctness: not kept; their
    rewards still return."""
    draw, _ = scripted_draw([[(1, 1, 1, 1), (1, 0, 1, 1)]], 4, penalty=lambda k, i, j: -0.1 * j)
    _, rewards, kept, used = dapo.sample_groups(draw, num_groups=2, group_size=4, max_rounds=1)
    assert kept.tolist() == [False, True]
    torch.testing.assert_close(rewards[:4], torch.tensor([1.0, 0.9, 0.8, 0.7]))


def test_asymmetric_clip_by_hand():
    old = torch.zeros(6)
    ratios = torch.tensor([1.3, 1.25, 1.1, 0.7, 0.75, 0.85])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    loss, clipped = dapo.compute_policy_loss(
        torch.log(ratios), old, adv, eps_low=0.2, eps_high=0.28
    )
    # A>0: min(ρ, clip(ρ, 0.8, 1.28)) -> 1.28 (clipped above at 1 + ε_high), 1.25 and 1.1 (inside
    # the range; a symmetric ε = 0.2 would have clipped 1.25 to 1.2). A<0: min(-ρ, -clip(ρ)) -> -0.8
    # (clipped below at 1 - ε_low), -0.8 (0.75 -> 0.8), -0.85 (inside).
    torch.testing.assert_close(loss, torch.tensor([-1.28, -1.25, -1.1, 0.8, 0.8, 0.85]))
    assert clipped.tolist() == [True, False, False, True, True, False]


def test_token_level_weights_by_hand():
    w = dapo.loss_weights([2, 4], dapo.Args())  # every token of the minibatch weighs 1/6
    assert w == [[1 / 6] * 2, [1 / 6] * 4]
    per_token = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 6.0])
    total = (per_token * torch.tensor([x for row in w for x in row])).sum()
    assert total.item() == pytest.approx(
        16 / 6
    )  # GRPO's per-response mean would give 0.5 * 2 + 0.5 * 3 = 2.5


def test_overlong_penalty_by_hand():
    args = dapo.Args(
        max_response_length=24, overlong_buffer=6
    )  # no penalty up to 18 tokens, -1 at 24
    got = [dapo.overlong_penalty(n, args) for n in (5, 18, 19, 21, 24)]
    assert got == pytest.approx([0.0, 0.0, -1 / 6, -0.5, -1.0])
    assert dapo.overlong_penalty(24, dapo.Args(overlong_buffer=0)) == 0.0


@pytest.fixture(scope="module")
def eager_model(tmp_path_factory, tiny_model_untied):
    """The untied tiny model with a large LM-head row for EOS, so responses end at different lengths
    (a random model almost never samples EOS, and truncated responses are left out of DAPO's
    loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("eager") / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_untied)
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] *= 100
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_untied).save_pretrained(path)
    return path


@pytest.mark.cpu_engine("fp32 engines: exact logprobs and an exact resume hold on CPU only")
def test_dapo_two_steps_end_to_end(eager_model, tmp_path):
    from transformers import AutoModelForCausalLM

    reward = (
        tmp_path / "parity.py"
    )  # mixed rewards from a random model: the parity of the response's length
    reward.write_text("def reward(response, answer):\n    return float(len(response) % 2)\n")
    out = tmp_path / "runs"
    flags = (
        "--model", eager_model, "--output-dir", str(out), "--num-steps", "2", "--num-generations", "4",
        "--prompts-per-step", "2", "--max-response-length", "8", "--overlong-buffer", "4", "--max-sampling-rounds", "2",
        "--engine-memory", "0.25", "--learning-rate", "1e-3", "--reward-fn", f"{reward}:reward", "--save-every", "1",
    )  # fmt: skip
    result = run_script("dapo.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[0]
    for r in rows[1:]:
        assert 1 <= r["rollout/sampling_rounds"] <= 2
        assert (
            r["rollout/prompts_skipped"] == (2 - r["rollout/sampling_rounds"]) * 2
        )  # unused rounds, counted
    trained = [r for r in rows[1:] if "train/loss" in r]
    assert trained, "no step had a group with mixed rewards"
    assert all(1 <= r["rollout/kept_groups"] <= 2 for r in trained)
    assert not any(k.startswith("train/kl") for r in rows for k in r)
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "final"))
    start = AutoModelForCausalLM.from_pretrained(eager_model)
    moved = max((a - b).abs().max().item() for a, b in zip(final.parameters(), start.parameters()))
    assert moved > 1e-5  # the trained groups changed the weights
    assert_resume_is_exact(
        "dapo.py", flags, run_dir
    )  # rounds are seeded per step, round and prompt


def test_compute_loss_by_hand():
    """DAPO: asymmetric clip, TIS weight, no KL term; weighted per token and summed."""
    args = dapo.Args(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0)
    logprobs = torch.log(
        torch.tensor([1.5, 1.25, 0.5])
    )  # ratios 1.5 (clipped to 1.28), 1.25 (inside), 0.5
    values = {
        "old_logprobs": torch.zeros(3),
        "engine_logprobs": torch.tensor([0.0, -math.log(4.0), 0.0]),  # TIS 1, 4 -> cap 2, 1
        "advantages": torch.tensor([1.0, 1.0, -1.0]),
        "loss_weights": torch.tensor([0.25, 0.25, 0.5]),
    }
    loss, stats = dapo.compute_loss(logprobs, values, args)
    # surrogate: -1.28, -1.25, -max(-0.5, -0.8) = 0.8 -> x TIS (1, 2, 1)
    assert loss.item() == pytest.approx(0.25 * -1.28 + 0.25 * -2.5 + 0.5 * 0.8)
    assert stats["clipfrac"].item() == 2 and set(stats) == {"clipfrac", "tis_weight"}


@pytest.mark.engine
def test_a_step_with_nothing_to_train_still_evaluates_logs_and_saves(eager_model, tmp_path):
    """A constant reward: every group is all-equal, so no step has anything to train (the cap comes
    first). Each step still evaluates on schedule, logs its samples, saves its checkpoint; the
    weights do not move."""
    from transformers import AutoModelForCausalLM

    reward = tmp_path / "constant.py"
    reward.write_text("def reward(response, answer):\n    return 0.0\n")
    out = tmp_path / "runs"
    result = run_script(
        "dapo.py", "--model", eager_model, "--output-dir", str(out), "--num-steps", "2", "--num-generations", "2",
        "--prompts-per-step", "2", "--max-response-length", "4", "--max-sampling-rounds", "2", "--engine-memory",
        "0.25", "--reward-fn", f"{reward}:reward", "--save-every", "1", "--eval-every", "1", "--overlong-buffer", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert "eval/accuracy" in r and "train/loss" not in r
        assert (
            r["rollout/sampling_rounds"] == 2
            and r["rollout/kept_groups"] == 0
            and r["rollout/prompts_skipped"] == 0
        )
    assert sorted({r["step"] for r in read_jsonl(os.path.join(run_dir, "samples.jsonl"))}) == [1, 2]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["final", "step_1"]
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "final"))
    start = AutoModelForCausalLM.from_pretrained(eager_model)
    assert all(torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters()))
