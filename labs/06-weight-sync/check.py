"""Grader of lab 06 (systems: break the weight sync on purpose and watch the logprob gap and the TIS weights).

python labs/06-weight-sync/check.py my_grpo.py [--no-run | --run-dir DIR]
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, expect, series  # noqa: E402

g = Grader("06", "grpo.py")
m = g.load()

with g.check(
    "Args has sync_every, an int, 1 by default",
    hint="add a field sync_every to Args; 1 keeps grpo.py as it is",
):
    fields = {f.name: f.default for f in dataclasses.fields(m.Args)}
    expect(
        fields.get("sync_every") == 1,
        f"sync_every default {fields.get('sync_every', '<missing>')!r}",
    )

with g.check(
    "should_sync(done, sync_every, num_steps): every sync_every steps, and after the last step",
    hint="`done` counts finished steps (1, 2, ...); the final eval must see the final weights",
):
    got = [m.should_sync(done, 1, 6) for done in range(1, 7)]
    expect(got == [True] * 6, f"sync_every 1: {got}")
    got = [m.should_sync(done, 2, 6) for done in range(1, 7)]
    expect(got == [False, True, False, True, False, True], f"sync_every 2, 6 steps: {got}")
    got = [m.should_sync(done, 3, 7) for done in range(1, 8)]
    expect(got == [False, False, True, False, False, True, True], f"sync_every 3, 7 steps: {got}")

if g.needs_run():
    flags = ["--sync-every", "2", "--num-steps", "4", "--eval-every", "100", "--eval-dataset", ""]
    rows = g.run(flags, required={"sync_every": 2})
    diff = series(rows, "train/logprob_diff_mean")
    tis = series(rows, "train/tis_weight")
    with g.check(
        "steps sampled from stale weights (2 and 4) show a logprob gap 10x that of fresh steps (1 and 3)",
        hint="after step 1 the push must be skipped: step 2 then samples with the weights of step 0",
    ):
        fresh, stale = max(diff[0], diff[2]), min(diff[1], diff[3])
        expect(
            stale > 10 * fresh, f"train/logprob_diff_mean per step {[round(x, 5) for x in diff]}"
        )
    with g.check(
        "the TIS weights move away from 1 on the stale steps",
        hint="train/tis_weight is the mean of min(π_θold / π_vllm, C): 1 to float precision only when the engine is in sync",
    ):
        fresh, stale = max(abs(tis[0] - 1), abs(tis[2] - 1)), min(abs(tis[1] - 1), abs(tis[3] - 1))
        expect(stale > fresh, f"train/tis_weight per step {[round(x, 4) for x in tis]}")
g.finish()
