"""Grader of lab 07 (async GRPO: the lag bound K of --max-lag, and what each K costs and buys).

python labs/07-async-lag/check.py my_grpo_async.py [--no-run | --run-dir DIR]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, close, expect, rounded, series  # noqa: E402

g = Grader("07", "grpo_async.py")
m = g.load()

with g.check(
    "is_stale(versions, step, K): a group is too old when any token's weights are older than step - K",
    hint="versions holds one list of per-token weight versions per response of the group",
):
    cases = [  # (versions, step, K, stale?)
        ([[3, 3, 4], [4, 4], [5]], 4, 0, True),
        ([[3, 3, 4], [4, 4], [5]], 4, 1, False),
        ([[3, 3, 4], [4, 4], [5]], 5, 1, True),
        ([[3, 3, 4], [4, 4], [5]], 5, 2, False),
        ([[4, 4], [5, 3, 5]], 6, 2, True),
        ([[4, 4], [5, 3, 5]], 6, 3, False),
        ([[7], [7, 7]], 7, 0, False),
    ]
    wrong = [
        f"is_stale({v}, step={step}, K={k}) returned {m.is_stale(v, step, k)!r}"
        for v, step, k, stale in cases
        if bool(m.is_stale(v, step, k)) != stale
    ]
    expect(not wrong, "; ".join(wrong[:3]))

with g.check(
    "lag_shares(lags, K): a list of K + 1 floats, the share of the tokens at each lag 0..K",
    hint="one number per lag k = 0, 1, ..., K, in a list (index k: lag k); they sum to 1 when no token is older than K",
):
    for lags, k, want in (
        ([0.0, 0.0, 1.0, 2.0, 1.0, 0.0, 0.0, 0.0], 2, [0.625, 0.25, 0.125]),
        ([0.0, 0.0], 1, [1.0, 0.0]),
    ):
        shares = m.lag_shares(torch.tensor(lags), k)
        got = f"{rounded(shares)} for lags {lags}, K = {k}"
        expect(
            isinstance(shares, (list, tuple)) or hasattr(shares, "tolist"),  # a tensor, an array
            f"a {type(shares).__name__} ({got}): return a list of K + 1 floats",
        )
        expect(close(shares, want), got)

if g.needs_run():
    flags = ["--max-lag", "2", "--num-steps", "3", "--eval-every", "100", "--eval-dataset", ""]
    rows = g.run(flags, required={"max_lag": 2})
    shares = [series(rows, f"rollout/lag_share_{k}") for k in range(3)]
    with g.check(
        "the run logs rollout/lag_share_0 .. rollout/lag_share_2 and they add up to 1 at every step",
        hint="log one metric per lag k = 0..K, named rollout/lag_share_<k>, from the per-token lags of the step",
    ):
        expect(
            all(len(s) == len(shares[0]) >= 3 for s in shares),
            f"{[len(s) for s in shares]} values per lag",
        )
        sums = [sum(step) for step in zip(*shares)]
        expect(
            all(close(x, 1.0, 1e-6) for x in sums), f"sums per step {[round(x, 4) for x in sums]}"
        )
    with g.check(
        "the pipeline fills: step 1 is all lag 0, a later step trains on older tokens",
        hint="with K > 0 the engines sample the next batches while one trains: their tokens are versions behind",
    ):
        expect(
            shares[0][0] == 1.0 and min(shares[0][1:]) < 1.0,
            f"rollout/lag_share_0 per step {[round(x, 3) for x in shares[0]]}",
        )
g.finish()
