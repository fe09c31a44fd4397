#!/usr/bin/env bash
# The test suite (make test runs this after setting up .venv). On a GPU machine, in two tiers:
#   1. everything that starts no vLLM engine, with CUDA hidden from every process and Ray actor
#      (CUDA_VISIBLE_DEVICES is inherited), so it checks what it checks on a laptop;
#   2. the tests that start vLLM engines (on the GPU, eager: POSTTRAIN_EAGER=1 skips minutes of
#      CUDA-graph capture per start; vLLM's CUDA build serves no CPU engine, so those that need the
#      CPU build are skipped, with the reason) and the GPU tier.
# Without CUDA the two tiers are one pytest run (CUDA is hidden anyway; one start-up instead of two).
# Extra arguments go to pytest (e.g. -k grpo). The slowest tests are listed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
status=0
tier() {  # name, marker expression, then env assignments for pytest
  local name=$1 expr=$2 rc
  shift 2
  echo "== tests: $name"
  local select=()
  [ -n "$expr" ] && select=(-m "$expr")
  env "$@" "$py" -m pytest tests "${select[@]}" --durations=25 "${args[@]}"
  rc=$?
  [ $rc -eq 5 ] && { echo "(no tests selected in this tier)"; rc=0; }
  [ $rc -eq 0 ] || status=$rc
}
args=("$@")
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  tier "without engines, CUDA hidden" "not (engine or cpu_engine or gpu)" CUDA_VISIBLE_DEVICES=
  tier "vLLM engines and the GPU tier" "engine or cpu_engine or gpu" POSTTRAIN_EAGER=1
else
  tier "all (no CUDA here: the GPU tier is skipped)" "" CUDA_VISIBLE_DEVICES=
fi
exit $status
