#!/usr/bin/env bash
# The GPU check, one step per call, each a few minutes at most (a lent GPU machine may give ~10 minutes a command):
#
#   bash benchmark/gpu_check.sh STEP          # from the repo root, on a machine with an NVIDIA GPU
#
#   0  environment: GPUs, driver, the Python and its pinned packages
#   1  the GPU test tier (pytest -m gpu); `1 -m engine` the tests that start vLLM engines, `1 -m engine -k ppo` a part
#      of them: engines start eager here (POSTTRAIN_EAGER=1: no CUDA-graph capture, minutes saved per start)
#   2  grpo.py, 3 steps on the built-in model, default flags (one GPU: colocated, which it prints)
#   3  the reference benchmark, colocated: 0.5B shape, 64 prompts x G = 8 x 512 tokens (target <= 19.9 s per step)
#   4  with 2+ GPUs: the same batch split (trainer GPU 0, engine GPU 1) and grpo_async.py on those two GPUs
#   5  ppo.py's hybrid engine on one GPU: 0.5B policy, critic and reward model with vLLM, all on GPU 0
#   report   the table for docs/benchmarks.md from what steps 0-5 wrote
#
# Each step writes its figures and logs to $RESULTS (default /tmp/posttrain-gpu/results) and ends with one line
# "step N: passed|FAILED|skipped ..."; a step can be re-run alone after a time limit. TRL 1.16's GRPOTrainer took
# 24.1 s per step on the reference config on one H100 (pure vLLM generation 14.9 s, pure FSDP2 training 3.5 s).
#
# Python: $PYTHON if set (it must import the pinned stack); else python3 when it imports the pinned stack (no setup,
# no network, no hub: the built-in model's wheel is part of the stack); else `make setup` and .venv/bin/python.
# Environment: RESULTS (where results go), WORK (runs and models, default /tmp/posttrain-gpu), STEPS (benchmark
# steps, default 5; the first is reported apart as warm-up).
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: bash benchmark/gpu_check.sh STEP (0-5 or report)}
shift
work=${WORK:-/tmp/posttrain-gpu}
results=${RESULTS:-$work/results}
steps=${STEPS:-5}
mkdir -p "$work" "$results"

pinned='import torch, vllm, ray, transformers, tyro
assert (torch.__version__.split("+")[0], vllm.__version__, ray.__version__, transformers.__version__) == \
    ("2.13.0", "0.32.0", "2.60.0", "5.19.0"), (torch.__version__, vllm.__version__, ray.__version__)'
if [ -n "${PYTHON:-}" ]; then
  if ! "$PYTHON" -c "$pinned" >/dev/null 2>&1; then
    echo "error: \$PYTHON=$PYTHON does not import the pinned stack: $("$PYTHON" -c "$pinned" 2>&1 | tail -1)" >&2
    exit 1
  fi
else
  if python3 -c "$pinned" >/dev/null 2>&1; then
    PYTHON=python3
  else
    make setup || exit 1
    PYTHON=.venv/bin/python
  fi
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$step" != report ] && [ "$gpus" -eq 0 ]; then
  echo "error: no NVIDIA GPU visible (nvidia-smi -L); this check is for GPU machines" >&2
  exit 1
fi

verdict() {  # step number, exit status of its command, what it ran
  local word=passed
  [ "$2" -eq 0 ] || word="FAILED (exit $2)"
  echo "step $1: $word: $3" | tee -a "$results/verdicts.txt"
  return "$2"
}

model() {  # a random-weight model of a known shape (benchmark/random_model.py), built once under $work
  "$PYTHON" benchmark/random_model.py "$1" "$work/$1-random${2:+-$2}" ${2:+--head $2} | tail -1
}

bench() {  # name, script, then its flags: the reference batch; GPU memory polled every 0.5 s meanwhile
  local name=$1 script=$2
  shift 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$results/$name.memory.log" &
  local poller=$!
  "$PYTHON" "$script" --model "$(model qwen2.5-0.5b)" --exp-name "$name" --output-dir "$work/$name" \
    --num-steps "$steps" --prompts-per-step 64 --max-response-length 512 --gradient-checkpointing \
    --max-tokens-per-micro-batch 16384 --eval-dataset "" --learning-rate 1e-6 --warmup-steps 0 "$@" \
    2>&1 | tee "$results/$name.log"
  local rc=${PIPESTATUS[0]}
  kill $poller 2>/dev/null
  if [ "$rc" -eq 0 ]; then
    "$PYTHON" benchmark/gpu_report.py "$(ls -d "$work/$name/$name"__* | tail -1)" --memory "$results/$name.memory.log" \
      | tee "$results/$name.md"
  fi
  return "$rc"
}

case "$step" in
0)
  {
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PYTHON" -c "import sys, torch, vllm, ray, transformers; print('python', sys.version.split()[0], '| torch',
torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__, '| ray', ray.__version__, '| transformers',
transformers.__version__, '| GPUs seen by torch:', torch.cuda.device_count())"
  } 2>&1 | tee "$results/0-environment.txt"
  "$PYTHON" -c "$pinned" 2>&1 | tail -1
  verdict 0 "${PIPESTATUS[0]}" "environment ($gpus GPU(s), $PYTHON)"
  ;;
1)
  [ $# -gt 0 ] || set -- -m gpu
  POSTTRAIN_EAGER=1 "$PYTHON" -m pytest tests "$@" -rs --durations=15 2>&1 | tee "$results/1-tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 5 ] && rc=0
  verdict 1 "$rc" "tests on the device, $* ($(grep -Eo '[0-9]+ (passed|failed|skipped)' "$results/1-tests.log" | paste -sd, -))"
  ;;
2)
  "$PYTHON" grpo.py --num-steps 3 --output-dir "$work/smoke" 2>&1 | tee "$results/2-smoke.log"
  verdict 2 "${PIPESTATUS[0]}" "grpo.py, 3 steps, built-in model, default flags ($(grep -m1 '^layout:' "$results/2-smoke.log"))"
  ;;
3)
  bench colocated grpo.py --num-generations 8 --colocate
  verdict 3 $? "reference benchmark, colocated on one GPU ($results/colocated.md)"
  ;;
4)
  if [ "$gpus" -lt 2 ]; then
    echo "step 4: skipped: needs 2 GPUs, this machine has $gpus" | tee -a "$results/verdicts.txt"
    exit 0
  fi
  bench split grpo.py --num-generations 8 --num-trainers 1 --num-engines 1 && \
    bench async grpo_async.py --num-generations 8 --num-trainers 1 --num-engines 1
  rc=$?
  "$PYTHON" benchmark/gpu_report.py "$work"/split/split__* "$work"/async/async__* >"$results/4-split-async.md" 2>&1
  verdict 4 $rc "the same batch split over 2 GPUs, and grpo_async.py ($results/4-split-async.md)"
  ;;
5)
  CUDA_VISIBLE_DEVICES=0 bench hybrid ppo.py --samples-per-prompt 2 --max-response-length 256 --reward-model "$(model qwen2.5-0.5b score)" \
    --dataset data/arithmetic/prompts_train.jsonl
  verdict 5 $? "ppo.py hybrid engine on one GPU: policy, critic, reward model and vLLM ($results/hybrid.md)"
  ;;
report)
  cat "$results/verdicts.txt" 2>/dev/null || echo "no step has run yet (results: $results)"
  grep -h "^python " "$results/0-environment.txt" 2>/dev/null
  for f in colocated 4-split-async hybrid; do
    if [ -f "$results/$f.md" ]; then
      printf '\n### %s\n' "$f"
      cat "$results/$f.md"
    fi
  done
  exit 0
  ;;
*)
  echo "error: unknown step $step (0-5 or report)" >&2
  exit 2
  ;;
esac
