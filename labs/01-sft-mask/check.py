"""Grader of lab 01 (SFT: the loss on the assistant's tokens only, or on every token).

python labs/01-sft-mask/check.py my_sft.py [--no-run | --run-dir DIR]
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import Grader, expect, series  # noqa: E402

g = Grader("01", "sft.py")
m = g.load()

with g.check(
    "Args has a flag all_tokens, a bool, off by default",
    hint="add `all_tokens: bool = False` to Args",
):
    fields = {f.name: f for f in dataclasses.fields(m.Args)}
    expect("all_tokens" in fields, "Args has no field all_tokens")
    expect(
        fields["all_tokens"].default is False, f"its default is {fields['all_tokens'].default!r}"
    )

with g.check(
    "make_sequence(ids, mask) still trains on the assistant's tokens only",
    hint="without all_tokens nothing changes: labels[t] = ids[t+1], trained iff token t+1 is an assistant token",
):
    given = "for ids [10, 11, 12, 13, 14], mask [0, 0, 1, 1, 1]"
    out = m.make_sequence([10, 11, 12, 13, 14], [0, 0, 1, 1, 1])
    expect(out["labels"] == [11, 12, 13, 14, 0], f"labels {out['labels']} {given}")
    expect(out["loss_mask"] == [0, 1, 1, 1, 0], f"loss_mask {out['loss_mask']} {given}")
    out = m.make_sequence([10, 11, 12, 13, 14, 15, 16], [0, 1, 1, 0, 0, 1, 1])  # two turns
    expect(
        out["loss_mask"] == [1, 1, 0, 0, 1, 1, 0],
        f"loss_mask {out['loss_mask']} for ids [10, ..., 16], mask [0, 1, 1, 0, 0, 1, 1]",
    )

with g.check(
    "all_token_targets(make_sequence(ids, mask)) trains on every token that has a next token",
    hint="every position t < T-1 predicts ids[t+1], prompt or not; the last position has nothing to predict",
):
    given = "for ids [10, 11, 12, 13, 14], mask [0, 0, 1, 1, 1]"
    out = m.all_token_targets(m.make_sequence([10, 11, 12, 13, 14], [0, 0, 1, 1, 1]))
    expect(out["input_ids"] == [10, 11, 12, 13, 14], f"input_ids {out['input_ids']} {given}")
    expect(out["labels"] == [11, 12, 13, 14, 0], f"labels {out['labels']} {given}")
    expect(out["loss_mask"] == [1, 1, 1, 1, 0], f"loss_mask {out['loss_mask']} {given}")
    out = m.all_token_targets(m.make_sequence([10, 11, 12, 13, 14, 15, 16], [0, 1, 1, 0, 0, 1, 1]))
    expect(
        out["loss_mask"] == [1] * 6 + [0],
        f"loss_mask {out['loss_mask']} for ids [10, ..., 16], mask [0, 1, 1, 0, 0, 1, 1]",
    )

with g.check(
    "edge cases: a one-token row, and a row that is all prompt",
    hint="a single token predicts nothing; with all_tokens a row's targets do not depend on its assistant mask",
):
    out = m.all_token_targets(m.make_sequence([7], [1]))
    expect(out["loss_mask"] == [0], f"loss_mask {out['loss_mask']} for ids [7], mask [1]")
    out = m.all_token_targets(m.make_sequence([7, 8, 9], [0, 0, 0]))
    expect(
        out["loss_mask"] == [1, 1, 0],
        f"loss_mask {out['loss_mask']} for ids [7, 8, 9], mask [0, 0, 0]",
    )

if g.needs_run():
    flags = ["--all-tokens", "--num-steps", "4", "--eval-every", "4", "--accuracy-dataset", ""]
    rows = g.run(flags, required={"all_tokens": True})
    steps = [r for r in rows if "train/tokens" in r]
    with g.check(
        "the run trains on (almost) every token of its rows",
        hint="with --all-tokens, does main train on all_token_targets of the training rows?",
    ):
        # perf/tokens_per_s x time/step = the tokens of the step's rows; one position per row has no target
        row_tokens = [r["perf/tokens_per_s"] * r["time/step"] for r in steps]
        share = [r["train/tokens"] / t for r, t in zip(steps, row_tokens)]
        expect(
            min(share) > 0.8,
            f"trained tokens / row tokens per step: {[round(s, 2) for s in share]}",
        )
    with g.check(
        "the training loss falls",
        hint="look at train/loss in metrics.jsonl: is the learning rate > 0?",
    ):
        loss = series(rows, "train/loss")
        expect(loss[-1] < loss[0], f"train/loss {[round(x, 3) for x in loss]}")
    with g.check(
        "the held-out loss on the assistant's tokens falls",
        hint="eval/loss should stay on the assistant's tokens (comparable between runs) and fall as the model learns",
    ):
        eval_loss = series(rows, "eval/loss")
        expect(
            len(eval_loss) >= 2 and eval_loss[-1] < eval_loss[0],
            f"eval/loss {[round(x, 3) for x in eval_loss]}",
        )
g.finish()
