"""ppo.py: GAE against a plain per-token loop, the per-token reward, value clipping, whitening, the
adaptive β and the critic's head, by hand; end-to-end runs with the rule verifier and with a reward
model."""

import math
import os
import re

import pytest
import torch
from conftest import (
    TOLERANCE,
    assert_resume_is_exact,
    logprob_gap,
    only_run_dir,
    read_jsonl,
    run_script,
)
from transformers import AutoModelForCausalLM

import ppo


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float):
    """The textbook loop over one response of length L: V after the last token is 0."""
    L, gae, advantages = len(rewards), 0.0, [0.0] * len(rewards)
    for t in reversed(range(L)):
        next_value = values[t + 1] if t + 1 < L else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        gae = delta + gamma * lam * gae
        advantages[t] = gae
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_plain_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 4, 7, 2]
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    scores = torch.randn(B, generator=g)
    logprobs, ref_logprobs = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    rewards, _ = ppo.compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    values = torch.randn(B, T, generator=g)
    garbage = (
        torch.randn(B, T, generator=g) * 100 * (1 - mask)
    )  # padding must not leak into real tokens
    advantages, returns = ppo.compute_gae(rewards + garbage, values + garbage, mask, gamma, lam)
    for i, n in enumerate(lengths):
        r = [-0.1 * (logprobs[i, t] - ref_logprobs[i, t]).item() for t in range(n)]
        r[-1] += scores[i].item()  # the terminal reward sits on the last real token
        torch.testing.assert_close(rewards[i, :n], torch.tensor(r))
        want_adv, want_ret = gae_reference(r, values[i, :n].tolist(), gamma, lam)
        torch.testing.assert_close(advantages[i, :n], torch.tensor(want_adv))
        torch.testing.assert_close(returns[i, :n], torch.tensor(want_ret))
        assert torch.equal(advantages[i, n:], torch.zeros(T - n)) and torch.equal(
            returns[i, n:], torch.zeros(T - n)
        )


def test_gae_by_hand():
    # one response of 2 tokens, γ = 0.5, λ = 0.5: δ_1 = 1 - 0.2 = 0.8, δ_0 = 0 + 0.5 * 0.2 - 0.1 = 0
    rewards, values, mask = (
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.tensor([[0.1, 0.2, 9.0]]),
        torch.tensor([[1.0, 1, 0]]),
    )
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.0 + 0.25 * 0.8, 0.8, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.3, 1.0, 0.0]]))


def test_value_clipping_by_hand():
    old = torch.tensor([0.0, 0.0, 1.0, 1.0])
    values = torch.tensor([0.5, 0.1, 0.5, 1.5])
    returns = torch.tensor([1.0, 1.0, 0.0, 2.0])
    loss, clipped = ppo.compute_value_loss(values, old, returns, value_clip_eps=0.2)
    # clipped values: 0.2, 0.1, 0.8, 1.2; squared errors unclipped 0.25, 0.81, 0.25, 0.25; clipped
    # 0.64, 0.81, 0.64, 0.64
    torch.testing.assert_close(loss, 0.5 * torch.tensor([0.64, 0.81, 0.64, 0.64]))
    assert clipped.tolist() == [True, False, True, True]
    # moving toward the return inside the clip range: the plain loss
    loss, clipped = ppo.compute_value_loss(
        torch.tensor([0.9]), torch.tensor([1.0]), torch.tensor([0.0]), 0.2
    )
    torch.testing.assert_close(loss, torch.tensor([0.405]))
    assert not clipped.item()


def test_whitening_by_hand():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, -50.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 1]])
    # real entries 1, 3, 5, 7: mean 4, biased variance (9 + 1 + 1 + 9) / 4 = 5
    want = torch.tensor([[-3.0, -1.0, 0.0], [1.0, 0.0, 3.0]]) / math.sqrt(5)
    torch.testing.assert_close(ppo.masked_whiten(x, mask), want)
    ev = ppo.explained_variance(torch.tensor([[1.0, 3.0, 0], [5.0, 0, 7.0]]), x, mask)
    assert ev == pytest.approx(1.0)


def test_adaptive_kl_controller_by_hand():
    # KL 3 vs target 2: error clipped to +0.2; β ← 0.1 (1 + 0.2 * 100 / 1000) = 0.102
    assert ppo.update_kl_coef(
        0.1, kl=3.0, target=2.0, horizon=1000, num_responses=100
    ) == pytest.approx(0.102)
    # KL 1.8 vs target 2: error -0.1; β ← 0.1 (1 - 0.1 * 50 / 100) = 0.095
    assert ppo.update_kl_coef(
        0.1, kl=1.8, target=2.0, horizon=100, num_responses=50
    ) == pytest.approx(0.095)
    assert ppo.update_kl_coef(
        0.1, kl=0.0, target=2.0, horizon=10, num_responses=10
    ) == pytest.approx(0.08)


def test_critic_starts_at_zero_and_reads_every_token(tiny_model):
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )  # for fully_shard
    critic = ppo.load_critic(tiny_model, torch.device("cpu"), False, pad_token_id=0)
    seq = ppo.make_sequence([5, 6, 7], [8, 9], seq_id=[3, 3])
    ids, mask = torch.tensor([seq["input_ids"]]), torch.tensor([seq["loss_mask"]])
    values = ppo.compute_values(critic, ids, torch.arange(5)[None], mask)
    assert values.shape == (2,) and torch.equal(
        values, torch.zeros(2)
    )  # a new head starts at V = 0
    with torch.no_grad():
        critic.score.weight.normal_()
    values = ppo.compute_values(critic, ids, torch.arange(5)[None], mask)
    assert values.abs().min() > 0 and values[0] != values[1]
    dist.destroy_process_group()


def ppo_args(model, out, *extra):
    return ("--model", model, "--output-dir", str(out), "--samples-per-prompt", "2", "--prompts-per-step", "4",
            "--max-response-length", "8", "--engine-memory", "0.25", "--learning-rate", "1e-4", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tokenizer):
    """A random 1-layer reward model whose scores spread over a few units (its head × 100), so that
    scoring the wrong token, or the wrong text, is far outside bf16's noise."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(100)
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def assert_rewards_are_the_models(run_dir, reward_model, tokenizer):
    """Every logged sample's reward is the reward model's score of its prompt + response (rm.py's
    input, the head at the last token), recomputed here in fp32; and the scores differ between
    samples by far more than the tolerance (a wrong token or text would show)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model, num_labels=1)
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    logged, want = [], []
    for s in samples:
        ids = torch.tensor([ppo.reward_model_input(tokenizer, s["prompt"], s["response"])])
        with torch.no_grad():
            want.append(model.score(model.base_model(input_ids=ids).last_hidden_state[0, -1]))
        logged.append(s["reward"])
    logged, want = torch.tensor(logged), torch.cat(want)
    assert (logged - want).abs().max() <= TOLERANCE["score"] * (1 + want.abs().max()), (
        logged,
        want,
    )
    assert want.std() > 3 * TOLERANCE["score"] * (1 + want.abs().max())


PPO_RUN = ("--num-steps", "2", "--kl-target", "0.5", "--kl-horizon", "16", "--save-every", "1")


@pytest.fixture(scope="module")
def ppo_run(tiny_model, reward_model, tmp_path_factory):
    """One ppo.py run with a reward model (scores that depend on what was sampled: a random tiny
    model never solves the task, and all-zero rewards would make every advantage, loss and gradient
    0). Two tests read it."""
    tmp = tmp_path_factory.mktemp("ppo")
    flags = ppo_args(tiny_model, tmp / "runs", *PPO_RUN, "--reward-model", reward_model)
    result = run_script("ppo.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return flags, only_run_dir(tmp / "runs")


@pytest.mark.cpu_engine("fp32 engines: exact logprobs and an exact resume hold on CPU only")
def test_ppo_end_to_end_with_a_reward_model_resumes_exactly(ppo_run, reward_model, tokenizer):
    """Every step logged with its metrics, the rewards the reward model's scores, step 2 sampled
    from the weights pushed after step 1, β adapting, and a resume from step_1 repeats step 2."""
    flags, run_dir = ppo_run
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert (
        [r["step"] for r in rows] == [0, 1, 2]
        and "eval/accuracy" in rows[0]
        and "eval/accuracy" in rows[-1]
    )
    for key in ("train/policy_loss", "train/value_loss", "train/clipfrac", "train/approx_kl", "train/kl",
                "train/explained_variance", "rollout/reward", "time/step", "perf/train_tokens_per_s"):  # fmt: skip
        assert key in rows[1] and key in rows[2], key
    assert (
        rows[2]["train/logprob_diff_max"] < 1e-3
    )  # step 2 sampled from the weights pushed after step 1
    assert rows[1]["train/kl"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as the reference
    assert rows[1]["train/kl_coef"] == 0.01 and rows[2]["train/kl_coef"] == pytest.approx(
        0.01 * (1 - 0.2 * 8 / 16)
    )
    assert all(r["train/grad_norm"] > 0 for r in rows[1:])
    assert_rewards_are_the_models(run_dir, reward_model, tokenizer)
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "final", "config.json"))
    # β adapted so far comes back from ppo_state.json; sampling is seeded per step and prompt
    assert_resume_is_exact("ppo.py", flags, run_dir)


@pytest.mark.cpu_engine("fp32 engines: exact logprobs and an exact resume hold on CPU only")
def test_sp2_matches_one_rank(ppo_run, tiny_model, tmp_path):
    # --sp-size 2: the policy and the critic each split every row over 2 ranks with ring attention.
    # The runs see the same rollouts (same start weights, same engine seed), so values, GAE, losses
    # and updates must agree.
    flags, run_dir = ppo_run
    sp2 = ("--num-trainers", "2", "--num-critics", "2", "--sp-size", "2", "--save-every", "0")
    result = run_script("ppo.py", *flags[: flags.index("--output-dir")], *flags[flags.index("--output-dir") + 2 :],
                        "--output-dir", str(tmp_path / "sp2"), *sp2)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {"one": read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    rows["sp2"] = read_jsonl(os.path.join(only_run_dir(tmp_path / "sp2"), "metrics.jsonl"))
    assert [r["step"] for r in rows["sp2"]] == [0, 1, 2]
    for one, sp2 in zip(rows["one"][1:], rows["sp2"][1:]):
        for key in ("rollout/reward", "rollout/value_mean", "rollout/return_mean", "train/policy_loss",
                    "train/value_loss", "train/approx_kl", "train/kl", "train/grad_norm", "train/critic_grad_norm",
                    "train/kl_coef"):  # fmt: skip
            assert sp2[key] == pytest.approx(one[key], abs=1e-4), (one["step"], key)
    first, second = rows["one"][1:]
    assert (
        first["train/grad_norm"] > 1e-3
        and first["train/critic_grad_norm"] > 1e-3
        and first["train/value_loss"] > 0
    )
    assert (
        abs(second["rollout/value_mean"]) > 1e-4
    )  # step 2's values come from the trained critic, not its zero head


# GPU tier: the hybrid engine on one GPU, chosen by default there: policy + reference, critic,
# reward model and the engine share GPU 0 (CUDA IPC weight sync, vLLM asleep while the models
# train). bf16 on both sides. The policy moves far enough that an engine left with stale weights
# fails step 2's check, and the rewards are the reward model's.
@pytest.mark.gpu
def test_ppo_hybrid_on_one_gpu(tiny_model, tokenizer, reward_model, tmp_path):
    flags = ppo_args(tiny_model, tmp_path / "runs", "--num-steps", "2", "--reward-model", reward_model,
                     "--learning-rate", "1e-3", "--warmup-steps", "0", "--save-every", "1")  # fmt: skip
    result = run_script("ppo.py", *flags, timeout=1800, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "layout: colocated on 1 GPU: this machine has 1, too few to give every actor its own"
        in result.stdout
    )
    assert re.search(r"^memory plan: GPU 0 .*: fits", result.stdout, re.M), result.stdout[-2000:]
    run_dir = only_run_dir(tmp_path / "runs")
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/grad_norm"] > 0 and r["perf/sync_probe_gap"] <= 0.25 for r in rows[1:])
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    step_1 = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "step_1"))
    samples = [s for s in read_jsonl(os.path.join(run_dir, "samples.jsonl")) if s["step"] == 2]
    stale = logprob_gap(start, step_1, tokenizer, samples)  # ~0.15 on CPU with these flags
    assert stale > 5 * TOLERANCE["logprob_mean"], f"the policy barely moved: {stale:.3g}"
    assert rows[2]["train/logprob_diff_mean"] < TOLERANCE["logprob_mean"]  # pushed after step 1
    assert_rewards_are_the_models(run_dir, reward_model, tokenizer)


def test_policy_and_critic_losses_by_hand():
    args = ppo.Args(clip_eps=0.2, value_clip_eps=0.2)
    logprobs = torch.log(
        torch.tensor([1.5, 1.0, 0.5])
    )  # ratios 1.5 (clipped to 1.2), 1.0, 0.5 (clipped to 0.8)
    values = {"old_logprobs": torch.zeros(3), "advantages": torch.tensor([1.0, 2.0, -1.0]),
              "loss_weights": torch.tensor([0.5, 0.25, 0.25])}  # fmt: skip
    loss, stats = ppo.compute_loss(logprobs, values, args)
    assert loss.item() == pytest.approx(
        0.5 * -1.2 + 0.25 * -2.0 + 0.25 * 0.8
    )  # no TIS weight in ppo.py
    assert stats["clipfrac"].item() == 2
    r = torch.tensor([1.5, 1.0, 0.5])  # k3 of KL(π_θold‖π_θ): (ρ - 1) - log ρ per token
    assert stats["approx_kl"].item() == pytest.approx(
        ((r - 1) - torch.log(r)).sum().item(), rel=1e-5
    )
    predicted = torch.tensor([0.5, 1.5])
    values = {"old_values": torch.tensor([0.0, 1.0]), "returns": torch.tensor([1.0, 2.0]),
              "loss_weights": torch.tensor([0.5, 0.5])}  # fmt: skip
    loss, stats = ppo.compute_critic_loss(predicted, values, args)
    # both clipped to 0.2 and 1.2: 0.5 * max(0.25, 0.64) and 0.5 * max(0.25, 0.64)
    assert (
        loss.item() == pytest.approx(0.5 * 0.32 + 0.5 * 0.32)
        and stats["value_clipfrac"].item() == 2
    )


def test_minibatches_are_packed_once_and_filled_by_token():
    """plan_minibatches packs the step's sequences once (the forward passes and training share
    them); fill_token_values puts each (B, T) value at its response token, whatever the packing and
    the ranks."""
    args = ppo.Args(
        samples_per_prompt=2,
        num_minibatches=2,
        num_trainers=2,
        num_critics=1,
        max_tokens_per_micro_batch=64,
    )
    batch = [ppo.Prompt([1, 2, 3], "1", "a", 1), ppo.Prompt([4, 5], "2", "b", 2)]
    responses = [{"token_ids": list(range(10, 10 + k))} for k in (3, 1, 2, 4)]
    shares = ppo.plan_minibatches(batch, responses, step=0, args=args)
    assert [len(group) for group in shares] == [2, 1] and all(
        len(rank) == 2 for g in shares for rank in g
    )
    values = (
        torch.arange(16.0).view(4, 4) + 100
    )  # (B, T): value of response i, token t = 100 + 4i + t
    ppo.fill_token_values(shares, returns=values)
    for group in shares:
        seen = []
        for rank in group:
            for mini in rank:
                for mb in mini:
                    m = mb["loss_mask"][0].bool()
                    want = 100 + 4 * mb["seq_id"][0, m] + mb["tok"][0, m]
                    torch.testing.assert_close(mb["returns"][0, m], want)
                    assert mb["returns"][0, ~m].abs().sum() == 0
                    seen += [
                        (int(i), int(t)) for i, t in zip(mb["seq_id"][0, m], mb["tok"][0, m])
                    ] * int(mb["real"])
        assert sorted(seen) == [
            (i, t) for i, n in enumerate((3, 1, 2, 4)) for t in range(n)
        ]  # every token once
