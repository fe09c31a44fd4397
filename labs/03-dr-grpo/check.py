"""Grader of lab 03 (GRPO's group-normalised advantages, and Dr. GRPO without the two normalisations).

python labs/03-dr-grpo/check.py my_dr_grpo.py [--no-run | --run-dir DIR]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, close, expect, rounded, series  # noqa: E402

g = Grader("03", "grpo.py")
m = g.load()

with g.check(
    "compute_advantages(rewards, G): each reward minus its group's mean, no division by the std",
    hint="rewards are (B*G,) prompt-major: view them as (B, G); Dr. GRPO drops GRPO's std normalisation",
):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    adv = m.compute_advantages(rewards, 4)
    expect(
        close(adv, [0.75, -0.25, -0.25, -0.25, -0.5, 0.5, -0.5, 0.5]),
        f"{rounded(adv)} for G = 4, {rewards.tolist()}",
    )
    adv = m.compute_advantages(torch.tensor([0.2, 0.4, 0.9]), 3)
    expect(close(adv, [-0.3, -0.1, 0.4]), f"{rounded(adv)} for non-binary rewards [0.2, 0.4, 0.9]")

with g.check(
    "a group whose rewards are all equal gets exactly zero advantage",
    hint="a float32 mean can be one ulp off (try [0.1] * 8): such a group must give exactly 0, not 1e-9",
):
    rewards = [0.1] * 8 + [1.0] * 8
    adv = m.compute_advantages(torch.tensor(rewards), 8)
    expect(bool((adv == 0).all()), f"{rounded(adv, 9)} for G = 8, [0.1] * 8 + [1.0] * 8 (float32)")

with g.check(
    "loss_weights(response_lengths, args): every token weighs 1 / (N * args.max_response_length)",
    hint="Dr. GRPO: sum the token losses and divide by a constant, not by each response's own length",
):
    weights = m.loss_weights([2, 3], m.Args(max_response_length=8))
    expect(
        [len(w) for w in weights] == [2, 3],
        f"lengths of the weight lists {[len(w) for w in weights]}",
    )
    expect(
        close(weights, [[1 / 16] * 2, [1 / 16] * 3]),
        f"{rounded(weights)} for lengths [2, 3], max_length 8",
    )
    weights = m.loss_weights([1, 4, 4, 24], m.Args(max_response_length=24))
    expect(
        close(sum(map(sum, weights)), 33 / (4 * 24)),
        f"weights summing to {sum(map(sum, weights)):.4f}",
    )

if g.needs_run():
    flags = ["--num-steps", "6", "--num-minibatches", "2", "--eval-every", "6"]
    rows = g.run(flags, required={"num_minibatches": 2})
    with g.check(
        "the run learns: greedy accuracy on the held-out prompts rises over 6 steps (0.42 -> 0.78 in ours)",
        hint="advantages must push up the responses that beat their group; check the sign and the weights",
    ):
        acc = series(rows, "eval/accuracy")
        expect(acc[-1] > acc[0], f"eval/accuracy {[round(x, 3) for x in acc]}")
g.finish()
