"""Grader of lab 02 (preferences: the DPO and IPO losses, likelihood displacement, and DPO + NLL).

python labs/02-dpo-displacement/check.py my_dpo.py [--no-run | --run-dir DIR]
"""

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, close, expect, rounded, series  # noqa: E402

g = Grader("02", "dpo.py")
m = g.load()
h = torch.tensor([2.0, 1.0, -3.0])  # log-ratio gaps Δ_c - Δ_r of three pairs

with g.check(
    "compute_dpo_loss is DPO's -log σ(β h) (Rafailov et al. eq. 7)",
    hint="h = Δ_c - Δ_r; the loss of a pair falls as β h grows; use a numerically stable log-sigmoid",
):
    loss = m.compute_dpo_loss(h, torch.zeros(3), beta=0.1)
    expect(
        close(
            loss,
            [math.log1p(math.exp(-0.2)), math.log1p(math.exp(-0.1)), math.log1p(math.exp(0.3))],
        ),
        f"losses {rounded(loss)} for h = [2, 1, -3], β = 0.1",
    )
    loss = m.compute_dpo_loss(torch.tensor([-400.0]), torch.tensor([0.0]), beta=1.0)
    expect(
        torch.isfinite(loss).all() and close(loss, [400.0], 1e-3),
        f"loss {rounded(loss)} for β h = -400",
    )

with g.check(
    "compute_dpo_loss(..., label_smoothing=ε) is cDPO's -(1 - ε) log σ(β h) - ε log σ(-β h)",
    hint="cDPO treats each label as flipped with probability ε: a mixture of the loss of the pair and of its flip",
):
    loss = m.compute_dpo_loss(h, torch.zeros(3), beta=0.1, label_smoothing=0.1)
    want = [
        0.9 * math.log1p(math.exp(-b)) + 0.1 * math.log1p(math.exp(b)) for b in (0.2, 0.1, -0.3)
    ]
    expect(close(loss, want), f"losses {rounded(loss)} for h = [2, 1, -3], β = 0.1, ε = 0.1")

with g.check(
    "compute_dpo_loss(..., ipo=True) is IPO's (h - 1/(2β))² (Azar et al. eq. 17)",
    hint="IPO regresses the gap h to a target margin set by β instead of pushing it to infinity",
):
    loss = m.compute_dpo_loss(h, torch.zeros(3), beta=0.1, ipo=True)
    expect(close(loss, [9.0, 16.0, 64.0]), f"losses {rounded(loss)} for h = [2, 1, -3], β = 0.1")

with g.check(
    "Args has nll_coef (α), a float, 0 by default", hint="add a field nll_coef to Args, default 0.0"
):
    fields = {f.name: f for f in dataclasses.fields(m.Args)}
    expect(
        "nll_coef" in fields and fields["nll_coef"].default == 0.0,
        "no field nll_coef with default 0.0",
    )

logprobs = torch.tensor([[-4.0, -6.0], [-3.0, -9.0]])  # (P, 2) summed log π_θ of (chosen, rejected)
ref_logprobs = torch.tensor([[-5.0, -5.0], [-3.0, -8.0]])
lengths = torch.tensor([[2.0, 3.0], [4.0, 1.0]])  # tokens of each response
given = f"for logprobs {logprobs.tolist()}, ref_logprobs {ref_logprobs.tolist()}, lengths {lengths.tolist()}"

with g.check(
    "compute_loss(logprobs, ref_logprobs, lengths, args) with nll_coef = 0 is plain DPO",
    hint="Δ = logprobs - ref_logprobs per response; it returns (per-pair losses, implicit rewards β Δ)",
):
    losses, rewards = m.compute_loss(logprobs, ref_logprobs, lengths, m.Args(beta=0.1))
    expect(
        close(losses, [math.log1p(math.exp(-0.2)), math.log1p(math.exp(-0.1))]),
        f"losses {rounded(losses)} {given}, β = 0.1",
    )
    expect(
        close(rewards, [[0.1, -0.1], [0.0, -0.1]]), f"rewards {rounded(rewards)} {given}, β = 0.1"
    )

with g.check(
    "compute_loss with nll_coef = α adds α times the chosen response's mean token NLL",
    hint="the NLL of a response is -log π_θ(y|x); 'mean token' divides it by that response's length; "
    "the rejected response gets no NLL term",
):
    losses, _ = m.compute_loss(logprobs, ref_logprobs, lengths, m.Args(beta=0.1, nll_coef=0.5))
    expect(
        close(losses, [math.log1p(math.exp(-0.2)) + 1.0, math.log1p(math.exp(-0.1)) + 0.375]),
        f"losses {rounded(losses)} {given}, β = 0.1, α = 0.5",
    )
    losses, _ = m.compute_loss(
        logprobs, ref_logprobs, lengths, m.Args(beta=0.1, nll_coef=0.5, ipo=True)
    )
    expect(
        close(losses, [10.0, 16.375]), f"losses {rounded(losses)} {given}, β = 0.1, α = 0.5, IPO"
    )

with g.check(
    "the NLL term's gradient pulls the chosen response up, and only it",
    hint="the term must depend on π_θ (logprobs), not on π_ref or on a detached copy",
):
    lp = logprobs.clone().requires_grad_(True)
    args = m.Args(beta=0.1, nll_coef=1.0)
    m.compute_loss(lp, ref_logprobs, lengths, args)[0].sum().backward()
    with_nll = lp.grad.clone()
    lp.grad = None
    m.compute_loss(lp, ref_logprobs, lengths, m.Args(beta=0.1))[0].sum().backward()
    diff = with_nll - lp.grad
    expect(
        close(diff, [[-0.5, 0.0], [-0.25, 0.0]]),
        f"d(loss)/d(logprobs) changed by {rounded(diff)} {given}, β = 0.1, α = 1",
    )

if g.needs_run():
    flags = ["--nll-coef", "1.0", "--num-steps", "6", "--eval-every", "6", "--accuracy-dataset", ""]
    rows = g.run(flags, required={"nll_coef": 1.0})
    with g.check(
        "with the NLL term the chosen responses' likelihood does not fall",
        hint="train/chosen_reward = β (log π_θ(y_c) - log π_ref(y_c)); is the NLL term in the loss you train on?",
    ):
        chosen = series(rows, "train/chosen_reward")
        expect(chosen[-1] > 0, f"train/chosen_reward {[round(x, 3) for x in chosen]}")
    with g.check(
        "the preference accuracy rises",
        hint="the DPO part of the loss must still separate the pairs",
    ):
        acc = series(rows, "eval/accuracy")
        expect(acc[-1] > acc[0], f"eval/accuracy {[round(x, 3) for x in acc]}")
g.finish()
