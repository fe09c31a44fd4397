#!/usr/bin/env bash
# The test suite in two tiers (make test runs this after setting up .venv):
#   1. everything that starts no vLLM engine, with CUDA hidden from every process and Ray actor (CUDA_VISIBLE_DEVICES
#      is inherited), so on a GPU machine it checks what it checks on a laptop;
#   2. the tests that start vLLM engines (on the GPU where there is one: vLLM's CUDA build serves no CPU engine; those
#      that need the CPU build are skipped, with the reason) and the GPU tier.
# Extra arguments go to both pytest runs (e.g. -k grpo). The slowest tests of each tier are listed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
status=0
tier() {  # name, marker expression, then env assignments for pytest
  local name=$1 expr=$2 rc
  shift 2
  echo "== tests: $name"
  env "$@" "$py" -m pytest tests -m "$expr" --durations=25 "${args[@]}"
  rc=$?
  [ $rc -eq 5 ] && { echo "(no tests selected in this tier)"; rc=0; }
  [ $rc -eq 0 ] || status=$rc
}
args=("$@")
tier "without engines, CUDA hidden" "not (engine or cpu_engine or gpu)" CUDA_VISIBLE_DEVICES=
tier "vLLM engines and the GPU tier" "engine or cpu_engine or gpu"
exit $status
