"""Grader of lab 05 (PPO: GAE(γ, λ), decoupled λ for the critic, and the variance of the advantages).

python labs/05-ppo-gae/check.py my_ppo.py [--no-run | --run-dir DIR --run-dir DIR2]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, close, expect, rounded, series  # noqa: E402

g = Grader("05", "ppo.py")
m = g.load()

# Two left-aligned responses: 3 tokens, and 2 tokens + 1 of padding (whose value 9 must not count).
rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
given = f"for rewards {rewards.tolist()}, values {values.tolist()}, mask {mask.tolist()}"
first = f"for rewards {rewards[:1].tolist()}, values {values[:1].tolist()}"

with g.check(
    "compute_gae with λ = 0 gives the one-step TD errors δ_t",
    hint="δ_t = r_t + γ V_t+1 - V_t, with V = 0 after a response's last token (and on its padding)",
):
    adv, _ = m.compute_gae(rewards, values, mask, 1.0, 0.0, 0.0)
    expect(
        close(adv, [[0.1, 0.1, 0.3], [-0.5, 1.5, 0.0]]),
        f"advantages {rounded(adv)} {given}, γ = 1, λ = 0",
    )

with g.check(
    "compute_gae with λ = 1 gives Monte-Carlo returns minus V",
    hint="Â_t = δ_t + γλ Â_t+1, run backwards in t; nothing flows back from padding",
):
    adv, _ = m.compute_gae(rewards, values, mask, 1.0, 1.0, 1.0)
    expect(
        close(adv, [[0.5, 0.4, 0.3], [1.0, 1.5, 0.0]]),
        f"advantages {rounded(adv)} {given}, γ = 1, λ = 1",
    )

with g.check(
    "compute_gae with γ = λ = 0.5 (a hand-computed case)",
    hint="both γ and λ discount the next advantage: Â_t = δ_t + γ λ Â_t+1; γ alone discounts V_t+1 in δ_t",
):
    adv, ret = m.compute_gae(rewards[:1], values[:1], mask[:1], 0.5, 0.5, 0.5)
    expect(close(adv, [[-0.24375, -0.175, 0.3]]), f"advantages {rounded(adv, 5)} {first}")
    expect(
        close(ret, [[0.25625, 0.425, 1.0]]),
        f"returns {rounded(ret, 5)} {first}, γ = 0.5, λ_critic = λ = 0.5",
    )

with g.check(
    "decoupled GAE: returns come from λ_critic, advantages from λ",
    hint="VC-PPO: the critic's targets R = Â(λ_critic) + V; with λ_critic = 1 they are the discounted returns",
):
    adv, ret = m.compute_gae(rewards[:1], values[:1], mask[:1], 0.5, 0.5, 1.0)
    expect(
        close(adv, [[-0.24375, -0.175, 0.3]]),
        f"advantages {rounded(adv, 5)} {first}, γ = 0.5, λ = 0.5, λ_critic = 1",
    )
    expect(
        close(ret, [[0.25, 0.5, 1.0]]), f"returns {rounded(ret, 5)} {first}, γ = 0.5, λ_critic = 1"
    )
    _, ret = m.compute_gae(rewards, values, mask, 1.0, 1.0, 0.0)
    expect(
        close(ret, [[0.6, 0.7, 1.0], [0.5, 2.0, 0.0]]),
        f"returns {rounded(ret)} {given}, γ = 1, λ_critic = 0",
    )

with g.check(
    "masked_var(x, mask): the variance over the masked entries only",
    hint="the biased variance (divide by the count) of the entries where mask is 1; padding does not count",
):
    var = m.masked_var(torch.tensor([[1.0, 3.0, 5.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    expect(close(var, 1.0), f"{rounded(var)} for x [[1, 3, 5]], mask [[1, 1, 0]]")
    var = m.masked_var(
        torch.tensor([[2.0, 2.0], [2.0, 7.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    )
    expect(close(var, 0.0), f"{rounded(var)} for x [[2, 2], [2, 7]], mask [[1, 1], [1, 0]]")

if g.needs_run():
    base = ["--num-steps", "1", "--eval-every", "100", "--eval-dataset", ""]
    td = g.run([*base, "--lam", "0"], required={"lam": 0.0})
    mc = g.run([*base, "--lam", "1"], required={"lam": 1.0})
    with g.check(
        "the advantages' variance (before whitening) grows from λ = 0 to λ = 1 on the same first batch",
        hint="rollout/advantage_var must be measured on the raw GAE advantages, before masked_whiten",
    ):
        a, b = series(td, "rollout/advantage_var")[0], series(mc, "rollout/advantage_var")[0]
        expect(0 < a < b, f"rollout/advantage_var at step 1: {a:.4g} (λ = 0) and {b:.4g} (λ = 1)")
g.finish()
