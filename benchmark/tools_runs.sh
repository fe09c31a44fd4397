#!/usr/bin/env bash
# The grpo_tools.py rows of docs/benchmarks.md: per seed, the sft.py warm start on the built-in task's
# transcripts, then grpo_tools.py (the calculator) and grpo.py (no tool) from that same warm start, on the same
# prompts, 20 steps each (the defaults); each summarised from its metrics.jsonl.
#   bash benchmark/tools_runs.sh 1 2 3
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-/tmp/posttrain-bench/tools}
mkdir -p "$out"
task=(--dataset data/multiply/prompts_train.jsonl --eval-dataset data/multiply/prompts_test.jsonl)
for seed in "${@:-1}"; do
  .venv/bin/python sft.py --dataset data/multiply/sft_train.jsonl --eval-dataset "" --accuracy-dataset "" \
    --num-steps 5 --warmup-steps 1 --seed "$seed" --output-dir "$out/warm$seed" > "$out/warm$seed.log" 2>&1
  warm=$(ls -d "$out/warm$seed"/sft__*/checkpoints/final | head -1)
  /usr/bin/time -f "wall %e s" .venv/bin/python grpo_tools.py --model "$warm" --seed "$seed" \
    --output-dir "$out/tools$seed" --no-save-final > "$out/tools$seed.log" 2>&1
  # grpo.py: the same prompts with no tool and no system message; the episode budget as its response's
  /usr/bin/time -f "wall %e s" .venv/bin/python grpo.py --model "$warm" --seed "$seed" "${task[@]}" \
    --max-response-length 64 --output-dir "$out/grpo$seed" --no-save-final > "$out/grpo$seed.log" 2>&1
  for run in "$out/tools$seed"/grpo_tools__* "$out/grpo$seed"/grpo__*; do
    .venv/bin/python benchmark/summarize.py "$run"
  done
done
