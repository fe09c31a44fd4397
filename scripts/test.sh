#!/usr/bin/env bash
# The test suite (make test runs this after setting up .venv). On a GPU machine, in two tiers:
#   1. everything that starts no vLLM engine, with CUDA hidden from every process and Ray actor
#      (CUDA_VISIBLE_DEVICES is inherited), so it checks what it checks on a laptop;
#   2. the tests that start vLLM engines (on the GPU, eager: POSTTRAIN_EAGER=1 skips minutes of
#      CUDA-graph capture per start; vLLM's CUDA build serves no CPU engine, so those that need the
#      CPU build are skipped, with the reason) and the GPU tier.
# Without CUDA the two tiers are one (CUDA is hidden anyway). A CPU tier runs in two parts: the
# tests marked `serial` (tight deadlines and measured waits: they measure the machine, so they get
# it alone) one after another, the rest on two pytest-xdist workers: a run spends much of its time
# waiting (Ray, imports, a driver that waits for its actors), so two at once fill the second core
# (docs/benchmarks.md has the figures); tests that read one shared run are sent to one worker
# (conftest.py). TEST_WORKERS=1 runs everything in one process. Extra arguments go to pytest (e.g.
# -k grpo). Each part lists its 30 slowest tests at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
workers=${TEST_WORKERS:-2}
"$py" -c "import xdist" 2>/dev/null || workers=1  # an environment without pytest-xdist: one process
status=0
part() {  # name, marker expression, xdist workers, then env assignments for pytest
  local name=$1 expr=$2 n=$3 rc
  shift 3
  echo "== tests: $name"
  local select=() spread=()
  [ -n "$expr" ] && select=(-m "$expr")
  [ "$n" -gt 1 ] && spread=(-n "$n" --dist loadgroup)
  env "$@" "$py" -m pytest tests "${select[@]}" "${spread[@]}" --durations=30 "${args[@]}"
  rc=$?
  [ $rc -eq 5 ] && { echo "(no tests selected here)"; rc=0; }
  [ $rc -eq 0 ] || status=$rc
}
tier() {  # name, marker expression, then env assignments: its serial part, then the rest
  local name=$1 expr=${2:-}
  shift 2
  local all="${expr:+($expr) and }"
  if [ "$workers" -gt 1 ]; then
    part "$name, serial" "${all}serial" 1 "$@"
    part "$name, the rest on $workers workers" "${all}not serial" "$workers" "$@"
  else
    part "$name" "$expr" 1 "$@"
  fi
}
# OpenMP threads that wait for work sleep at once instead of spinning: a spinning thread takes the
# core another test's process needs (test_dpo's end-to-end test beside one busy core: 69 s spinning,
# 41 s with this; test_dapo.py and test_ppo.py on two workers: 415 s -> 295 s).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
args=("$@")
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  tier "without engines, CUDA hidden" "not (engine or cpu_engine or gpu)" CUDA_VISIBLE_DEVICES=
  part "vLLM engines and the GPU tier" "engine or cpu_engine or gpu" 1 POSTTRAIN_EAGER=1
else
  tier "all (no CUDA here: the GPU tier is skipped)" "" CUDA_VISIBLE_DEVICES=
fi
echo "== tests: ${SECONDS} s in all, set-up excluded (exit status $status)"
exit $status
