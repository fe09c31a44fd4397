"""Grader of lab 04 (from GRPO to DAPO: clip-higher and dynamic sampling, one at a time).

python labs/04-grpo-to-dapo/check.py my_dapo.py [--no-run | --run-dir DIR ...]
"""

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, close, expect, rounded, series  # noqa: E402

g = Grader("04", "grpo.py")
m = g.load()

with g.check(
    "Args has clip_eps_high (default 0.2, PPO's symmetric clip) and dynamic_sampling (default off)",
    hint="two new fields in Args; with their defaults the script must still be grpo.py",
):
    fields = {f.name: f.default for f in dataclasses.fields(m.Args)}
    expect(
        fields.get("clip_eps_high") == 0.2,
        f"clip_eps_high default {fields.get('clip_eps_high', '<missing>')!r}",
    )
    expect(
        fields.get("dynamic_sampling") is False,
        f"dynamic_sampling default {fields.get('dynamic_sampling', '<missing>')!r}",
    )

ratios = torch.tensor([1.25, 1.25, 0.75, 0.7])
old = torch.zeros(4)
logprobs = old + ratios.log()
advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
given = "for ratios [1.25, 1.25, 0.75, 0.7], Â [1, -1, -1, 1]"

with g.check(
    "compute_policy_loss(logprobs, old_logprobs, advantages, 0.2, 0.2) is PPO's clipped surrogate",
    hint="with ε_high = ε the clip is symmetric, [1 - ε, 1 + ε], as in grpo.py",
):
    loss, clipped = m.compute_policy_loss(logprobs, old, advantages, 0.2, 0.2)
    expect(
        close(loss, [-1.2, 1.25, 0.8, -0.7]),
        f"loss {rounded(loss)} {given}, ε = ε_high = 0.2",
    )
    expect(
        clipped.tolist() == [True, False, True, False],
        f"clipped {clipped.tolist()} {given}, ε = ε_high = 0.2",
    )

with g.check(
    "compute_policy_loss with ε = 0.2, ε_high = 0.28 clips the ratio to [0.8, 1.28]",
    hint="DAPO §3.1: only the upper end of the clip moves; the lower one stays 1 - ε",
):
    loss, clipped = m.compute_policy_loss(logprobs, old, advantages, 0.2, 0.28)
    expect(
        close(loss, [-1.25, 1.25, 0.8, -0.7]), f"loss {rounded(loss)} {given}, ε 0.2, ε_high 0.28"
    )
    expect(
        clipped.tolist() == [False, False, True, False],
        f"clipped {clipped.tolist()} {given}, ε 0.2, ε_high 0.28",
    )
    loss, clipped = m.compute_policy_loss(
        torch.tensor([math.log(1.5)]), torch.zeros(1), torch.ones(1), 0.2, 0.28
    )
    expect(
        close(loss, [-1.28]) and clipped.tolist() == [True],
        f"loss {rounded(loss)}, clipped {clipped.tolist()} for ratio 1.5, Â = 1, ε 0.2, ε_high 0.28",
    )

values = {  # the micro-batch's per-token values as compute_loss gets them; TIS weight 1, w_t = 1/4
    "old_logprobs": old,
    "engine_logprobs": old,
    "advantages": advantages,
    "loss_weights": torch.full((4,), 0.25),
}
with g.check(
    "compute_loss clips the ratio to [1 - ε, 1 + ε_high], from args.clip_eps and args.clip_eps_high",
    hint="compute_policy_loss takes both ends of the clip: compute_loss must pass ε_high as the upper one",
):
    loss, stats = m.compute_loss(logprobs, values, m.Args(clip_eps=0.2, clip_eps_high=0.28))
    clipped = stats["clipfrac"].item()
    expect(
        close(loss, 0.25 * (-1.25 + 1.25 + 0.8 - 0.7)) and clipped == 1,
        f"loss {rounded(loss)}, {clipped:g} clipped tokens {given}, weights 1/4, ε 0.2, ε_high 0.28",
    )
    loss, stats = m.compute_loss(logprobs, values, m.Args(clip_eps=0.2, clip_eps_high=0.2))
    clipped = stats["clipfrac"].item()
    expect(
        close(loss, 0.25 * (-1.2 + 1.25 + 0.8 - 0.7)) and clipped == 2,
        f"loss {rounded(loss)}, {clipped:g} clipped tokens {given}, weights 1/4, ε = ε_high = 0.2",
    )

rewards = torch.tensor(
    [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0]
)
with g.check(
    "keep_groups(rewards, G, dynamic_sampling): all groups without it, only groups with a signal with it",
    hint="DAPO §3.2: a group whose G rewards are all equal has Â = 0 for every response: no signal",
):
    kept = m.keep_groups(rewards, 4, False)
    expect(kept.tolist() == [True] * 4, f"without dynamic sampling: {kept.tolist()}")
    kept = m.keep_groups(rewards, 4, True)
    expect(
        kept.tolist() == [True, False, False, True],
        f"with dynamic sampling: {kept.tolist()} for {rewards.tolist()}",
    )

if g.needs_run():
    base = ["--num-steps", "1", "--num-minibatches", "2", "--eval-every", "100"]
    base += ["--eval-dataset", ""]
    settings = {"clip_eps_high": 0.2, "dynamic_sampling": False, "num_minibatches": 2}
    # the parent's run is the variant at its defaults
    sym = g.run(base, required=settings, parent_ok=True)
    high = g.run([*base, "--clip-eps-high", "0.28"], required={**settings, "clip_eps_high": 0.28})
    dyn = g.run([*base, "--dynamic-sampling"], required={**settings, "dynamic_sampling": True})
    with g.check(
        "clip-higher clips fewer tokens than the symmetric clip on the same first batch",
        hint="the first step samples the same responses in both runs; only the clip range differs",
    ):
        a, b = series(sym, "train/clipfrac")[0], series(high, "train/clipfrac")[0]
        expect(b < a, f"train/clipfrac at step 1: {a:.4f} (ε_high 0.2) and {b:.4f} (ε_high 0.28)")
    with g.check(
        "dynamic sampling trains on the groups with a signal only, on the same first batch",
        hint="fewer groups means fewer tokens trained: is keep_groups's answer used to pick the sequences?",
    ):
        share = series(dyn, "rollout/signal_groups")[0]
        tokens = [
            series(r, "perf/train_tokens_per_s")[0] * series(r, "time/train")[0] for r in (sym, dyn)
        ]
        expect(
            0 < share < 1, f"rollout/signal_groups at step 1: {share:.3f}, so the check cannot tell"
        )
        expect(
            tokens[1] < 0.95 * tokens[0],
            f"trained {tokens[1]:.0f} tokens with it, {tokens[0]:.0f} without",
        )
g.finish()
