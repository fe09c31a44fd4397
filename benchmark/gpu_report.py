"""The GPU benchmark table for docs/benchmarks.md, from grpo.py run directories and a GPU memory
log.

    python benchmark/gpu_report.py RUN_DIR [RUN_DIR ...] [--memory nvidia-smi.log]

Per run: seconds per step for generation, training, weight sync and the whole step (mean over the
steps after the first, which also pays one-time allocator and kernel warm-up; the first step is
shown apart), mean response length, generated and trained tokens per second, and the peak GPU memory
that nvidia-smi saw (all processes, MiB, one value per line of the log). The step-time target: the
colocated reference config within 19.9 s.
"""

import argparse
import json
import os

TARGET_STEP_S = (
    19.9  # 1.08 x (14.9 s pure generation + 3.5 s pure training), both measured on one H100
)


def report(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip() and "time/step" in line]
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    later = rows[1:] or rows

    def mean(key):
        return sum(r.get(key, float("nan")) for r in later) / len(later)

    a = config["args"]
    return {
        "run": os.path.basename(run_dir), "script": config.get("script", "grpo.py"),
        "layout": f"{a['num_trainers']} trainer(s), {a['num_engines']} engine(s)" + (", colocated" if a["colocate"] else ""),
        "steps": len(rows), "first step (s)": rows[0]["time/step"], "generate (s)": mean("time/generate"),
        "wait for data (s)": mean("time/wait_rollouts"), "lag": mean("rollout/lag_mean"),
        "train (s)": mean("time/train"), "sync (s)": mean("time/sync"), "step (s)": mean("time/step"),
        "response length": mean("rollout/response_length"), "generated tok/s": mean("perf/generate_tokens_per_s"),
        "trained tok/s": mean("perf/train_tokens_per_s"), "versions": config.get("versions", {}),
    }  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+")
    parser.add_argument(
        "--memory", help="nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits log"
    )
    args = parser.parse_args()
    peak = None
    if args.memory and os.path.exists(args.memory):
        with open(args.memory) as f:
            values = [int(v) for line in f for v in line.replace(",", " ").split() if v.isdigit()]
        peak = max(values) if values else None
    rows = [report(r) for r in args.runs]
    keys = [k for k in rows[0] if k != "versions"]
    print("| " + " | ".join(keys + ["peak GPU memory (MiB)"]) + " |")
    print("|" + " --- |" * (len(keys) + 1))
    for r in rows:
        cells = [f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        print("| " + " | ".join(cells + [str(peak) if peak is not None else "n/a"]) + " |")
    print(f"versions: {rows[0]['versions']}")
    for r in rows:
        if "colocated" in r["layout"]:
            verdict = "within" if r["step (s)"] <= TARGET_STEP_S else "OVER"
            print(
                f"{r['run']}: {r['step (s)']:.2f} s per step, {verdict} the {TARGET_STEP_S} s target"
            )
        print(f"{r['run']}: weight sync {r['sync (s)']:.2f} s per step (target < 1 s for 0.5B)")
    # grpo_async.py's target: a step within 1.1 x max(generation, training) of grpo.py's split run
    # (same batch)
    split = [r for r in rows if r["script"] == "grpo.py" and "colocated" not in r["layout"]]
    for r in rows:
        if r["script"] == "grpo_async.py" and split:
            bound = 1.1 * max(split[0]["generate (s)"], split[0]["train (s)"])
            verdict = "within" if r["step (s)"] <= bound else "OVER"
            print(
                f"{r['run']}: {r['step (s)']:.2f} s per step, {verdict} 1.1 x max(generate, train) = {bound:.2f} s"
            )


if __name__ == "__main__":
    main()
