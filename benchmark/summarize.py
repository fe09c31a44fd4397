"""Summarise run directories: the figures docs/benchmarks.md reports, computed from metrics.jsonl.

    python benchmark/summarize.py runs/grpo__1__* runs/grpo__2__* ...

Per run: steps, mean reward over the first and last 5 steps (RL scripts), the first and last
held-out accuracy, mean seconds per step, and the time from config.json (written after start-up) to
the last metrics row. The whole process's wall time, start-up included, is taken with /usr/bin/time
in default_runs.sh.
"""

import json
import os
import sys


def summarize(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = {"run": os.path.basename(run_dir), "steps": max(r["step"] for r in rows)}
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    if rewards:
        out["reward_first5"] = sum(rewards[:5]) / len(rewards[:5])
        out["reward_last5"] = sum(rewards[-5:]) / len(rewards[-5:])
    for key in ("eval/accuracy", "eval/pair_accuracy", "eval/preference_accuracy"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"{key} first"], out[f"{key} last"] = values[0], values[-1]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    if steps:
        out["mean time/step (s)"] = sum(steps) / len(steps)
    start = os.path.getmtime(os.path.join(run_dir, "config.json"))
    out["run dir wall (s)"] = os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")) - start
    return out


if __name__ == "__main__":
    for d in sys.argv[1:]:
        print(
            json.dumps(
                {k: round(v, 4) if isinstance(v, float) else v for k, v in summarize(d).items()}
            )
        )
