"""Turn runs' metrics.jsonl into PNG curves, a figure per metric group (train/, eval/, ...).

    python plot.py runs/grpo__1__1763800000 [more run dirs...] [--out plots/] [--x time]

Several runs are drawn on the same axes, so seeds or variants compare at a glance. `--x time` puts
the seconds the steps took (the running sum of time/step; start-up and evaluation left out) on the
x axis instead of the step, to compare how fast runs learn in wall-clock terms (e.g. grpo.py
against grpo_async.py)."""

import argparse
import json
import os
from collections import defaultdict


def load_metrics(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    series = defaultdict(list)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series[key].append((row["step"], value))
    return series


def step_seconds(series: dict) -> dict[int, float]:
    """Step -> seconds of training steps up to and including it (the running sum of time/step)."""
    elapsed, total = {0: 0.0}, 0.0
    for step, seconds in sorted(series.get("time/step", [])):
        total += seconds
        elapsed[step] = total
    return elapsed


def plot_runs(run_dirs: list[str], out_dir: str, x="step", keys: list[str] | None = None) -> list:
    """A PNG per metric group (train, eval, ...), or with `keys` one PNG of those (selected.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(d)): load_metrics(d) for d in run_dirs}
    groups = defaultdict(set)  # with `keys`: one group, "selected"
    for key in {key for series in runs.values() for key in series if not keys or key in keys}:
        groups["selected" if keys else key.split("/")[0] if "/" in key else "other"].add(key)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for group, names in sorted(groups.items()):
        names = sorted(names, key=keys.index) if keys else sorted(names)
        cols = min(3, len(names))
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
        for ax, key in zip(axes.flat, names):
            for name, series in runs.items():
                if key in series:
                    steps, values = zip(*series[key])
                    if x == "time":
                        elapsed = step_seconds(series)
                        timed = [(elapsed[s], v) for s, v in series[key] if s in elapsed]
                        steps, values = zip(*timed)
                    ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=name)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step" if x == "step" else "seconds of training steps", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        if len(runs) > 1:  # every run, whichever panels it has
            lines = {line.get_label(): line for ax in axes.flat for line in ax.get_lines()}
            handles, labels = list(lines.values()), list(lines)
            fig.legend(handles, labels, loc="lower center", ncol=len(lines), fontsize=8)
        fig.tight_layout(rect=(0, 0.08 / rows if len(runs) > 1 else 0, 1, 1))
        path = os.path.join(out_dir, f"{group}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    about = "Plot metrics.jsonl of one or more run directories."
    parser = argparse.ArgumentParser(description=about)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="output folder (default: <first run>/plots)")
    x_help = "x axis: step, or seconds of steps"
    parser.add_argument("--x", choices=["step", "time"], default="step", help=x_help)
    keys_help = "only these metrics, in one figure (selected.png)"
    parser.add_argument("--keys", nargs="+", help=keys_help)
    cli = parser.parse_args()
    for d in cli.run_dirs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            raise SystemExit(f"error: {d} has no metrics.jsonl")
    out_dir = cli.out or os.path.join(cli.run_dirs[0], "plots")
    for path in plot_runs(cli.run_dirs, out_dir, cli.x, cli.keys):
        print(path)
