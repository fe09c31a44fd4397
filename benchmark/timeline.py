"""Who waits for whom: a timeline of the trainers and the engines, grpo.py against grpo_async.py,
from real runs.

    python benchmark/timeline.py <grpo.py run dir> <grpo_async.py run dir> --out docs/img/timeline.png [--steps 6]

grpo.py's bars come from its metrics.jsonl (time/generate, time/train, time/sync of each step, laid
end to end: it does one thing at a time; run it with --eval-dataset "" so no evaluation falls
between steps). grpo_async.py's come from the timeline.json it writes: the wall-clock phases of
every step, and each engine's idle and paused intervals (it generated the rest of the time).
"""

import argparse
import json
import os

COLORS = {
    "generate": "tab:blue",
    "wait": "0.85",
    "train": "tab:orange",
    "sync": "tab:red",
    "idle": "0.85",
}


def grpo_bars(run_dir: str, steps: int) -> dict[str, list]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/train" in r][:steps]
    bars, t = {"trainer": [], "engine 0": []}, 0.0
    for r in rows:
        gen, train, sync = r["time/generate"], r["time/train"], r["time/sync"]
        bars["engine 0"] += [
            (t, gen, "generate"),
            (t + gen, train, "idle"),
            (t + gen + train, sync, "sync"),
        ]
        bars["trainer"] += [
            (t, gen, "wait"),
            (t + gen, train, "train"),
            (t + gen + train, sync, "sync"),
        ]
        t += gen + train + sync
    return bars


def async_bars(run_dir: str, steps: int) -> dict[str, list]:
    with open(os.path.join(run_dir, "timeline.json")) as f:
        timeline = json.load(f)
    phases = timeline["steps"][:steps]
    t0, end = phases[0][0], phases[-1][3]
    bars = {"trainer": []}
    for start, data, trained, synced in phases:
        bars["trainer"] += [(start - t0, data - start, "wait"), (data - t0, trained - data, "train"),
                            (trained - t0, synced - trained, "sync")]  # fmt: skip
    for i, intervals in enumerate(timeline["engines"]):
        row = [(0.0, end - t0, "generate")]  # busy unless idle or paused
        for what, a, b in intervals:
            a, b = max(a, t0), min(b, end)
            if b > a:
                row.append((a - t0, b - a, "idle" if what == "idle" else "sync"))
        bars[f"engine {i}"] = row
    return bars


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grpo_run")
    parser.add_argument("async_run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6, help="the first N steps")
    cli = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = {
        "grpo.py": grpo_bars(cli.grpo_run, cli.steps),
        "grpo_async.py": async_bars(cli.async_run, cli.steps),
    }
    span = max(s + w for bars in panels.values() for row in bars.values() for s, w, _ in row)
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True)
    for ax, (name, bars) in zip(axes, panels.items()):
        for y, segments in enumerate(bars.values()):
            for kind in ("generate", "wait", "idle", "train", "sync"):  # the background first
                spans = [(s, w) for s, w, k in segments if k == kind]
                ax.broken_barh(spans, (y - 0.35, 0.7), color=COLORS[kind])
        ax.set_yticks(range(len(bars)), list(bars))
        ax.set_title(f"{name}: first {cli.steps} steps", fontsize=10, loc="left")
        ax.set_xlim(0, span * 1.01)
    axes[-1].set_xlabel("seconds since the first step started")
    legend = [Patch(color=COLORS[k], label=label) for k, label in
              [("generate", "generating"), ("train", "rewards + training"), ("sync", "weight sync (engine paused)"),
               ("idle", "waiting")]]  # fmt: skip
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(cli.out)), exist_ok=True)
    fig.savefig(cli.out, dpi=110)
    print(cli.out)


if __name__ == "__main__":
    main()
