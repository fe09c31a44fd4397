#!/usr/bin/env bash
# The vision rows of docs/benchmarks.md: per seed, the sft.py warm start of the built-in VLM
# (builtin:SmolLM2-135M-Vision) on the built-in shapes task, then grpo.py from it on the same task's
# prompts, the vision tower trained in both (the settings of docs/vision.md); held-out greedy accuracy
# before and after each (sft.py: on the trainers; grpo.py: on the engines).
#   bash benchmark/vision_runs.sh 1 2 3
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-/tmp/posttrain-bench/vision}
mkdir -p "$out"
for seed in "${@:-1}"; do
  /usr/bin/time -f "wall %e s" .venv/bin/python sft.py --model builtin:SmolLM2-135M-Vision \
    --dataset data/shapes/sft_train.jsonl --eval-dataset data/shapes/sft_test.jsonl \
    --accuracy-dataset data/shapes/prompts_test.jsonl --num-steps 30 --learning-rate 1e-4 --eval-every 30 \
    --max-new-tokens 8 --train-vision --seed "$seed" --output-dir "$out/sft$seed" > "$out/sft$seed.log" 2>&1
  warm=$(ls -d "$out/sft$seed"/sft__*/checkpoints/final | head -1)
  /usr/bin/time -f "wall %e s" .venv/bin/python grpo.py --model "$warm" --dataset data/shapes/prompts_train.jsonl \
    --eval-dataset data/shapes/prompts_test.jsonl --max-response-length 8 --train-vision --prompts-per-step 24 \
    --num-steps 15 --eval-every 5 --learning-rate 1e-5 --seed "$seed" --output-dir "$out/grpo$seed" \
    --no-save-final > "$out/grpo$seed.log" 2>&1
  for run in "$out/sft$seed"/sft__* "$out/grpo$seed"/grpo__*; do
    .venv/bin/python benchmark/summarize.py "$run"
  done
done
