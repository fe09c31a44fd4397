#!/usr/bin/env bash
# The default runs behind docs/benchmarks.md: each script with no flags (built-in model and data), timed as a
# whole process, then summarised from its metrics.jsonl.
#   bash benchmark/default_runs.sh grpo.py 1 2 3      # script, then seeds (default: 1)
#   FLAGS="--lora-rank 16 --learning-rate 2e-4" bash benchmark/default_runs.sh grpo.py 1   # extra flags
set -euo pipefail
cd "$(dirname "$0")/.."
script=${1:-grpo.py}; shift || true
out=${OUT_DIR:-/tmp/posttrain-bench}
mkdir -p "$out"
for seed in "${@:-1}"; do
  log="$out/${script%.py}_seed$seed${FLAGS:+_$(echo "$FLAGS" | tr -c 'a-z0-9.\n' '_')}.log"
  # shellcheck disable=SC2086  # FLAGS: words on purpose
  /usr/bin/time -f "wall %e s  max RSS of the driver %M KB" .venv/bin/python "$script" --seed "$seed" \
    --output-dir "$out" ${FLAGS:-} > "$log" 2>&1
  tail -1 "$log"
  run=$(ls -dt "$out/${script%.py}__${seed}__"* | head -1)
  .venv/bin/python benchmark/summarize.py "$run"
done
