#!/usr/bin/env bash
# One command for a GPU machine: set up, run the GPU test tier, a 3-step colocated grpo.py on the built-in model,
# then the reference benchmark, and print its table for docs/benchmarks.md.
#
#   bash benchmark/gpu_check.sh                  # from the repo root, on a machine with an NVIDIA GPU
#
# Reference config (the one TRL's GRPOTrainer was measured on with this stack on one H100: 24.1 s per step;
# pure vLLM generation of the batch 14.9 s, pure FSDP2 training 3.5 s; target for grpo.py: <= 19.9 s):
# a random-weight model of Qwen2.5-0.5B's shape (vocab of the built-in tokenizer, built here: no hub),
# 64 prompts x G = 8 x 512 response tokens (random weights never stop early), bf16, gradient checkpointing,
# trainer and vLLM colocated on one GPU, one optimizer step per rollout batch. With 2+ GPUs it also runs the
# split layout (trainer on GPU 0, engine on GPU 1: NCCL weight sync), and grpo_async.py on the same two GPUs
# (target: a step within 1.1 x max(generation, training) of the split grpo.py run).
#
# Environment: PYTHON  a Python with the pinned GPU stack (default: `make setup`, then .venv/bin/python)
#              OUT_DIR where runs and logs go (default /tmp/posttrain-gpu)
#              STEPS   benchmark steps (default 5; the first is reported apart as warm-up)
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "error: no NVIDIA GPU visible (nvidia-smi -L failed); this check is for GPU machines" >&2
  exit 1
fi
if [ -z "${PYTHON:-}" ]; then
  make setup || exit 1
  PYTHON=.venv/bin/python
fi
out=${OUT_DIR:-/tmp/posttrain-gpu}
steps=${STEPS:-5}
gpus=$(nvidia-smi -L | wc -l)
mkdir -p "$out"
failed=()
nvidia-smi -L
"$PYTHON" -c "import torch, vllm, ray, transformers
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__, '| ray', ray.__version__,
      '| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))" || exit 1

echo "== 1/3 GPU test tier"
"$PYTHON" -m pytest -m gpu tests -q -rs -p no:cacheprovider
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 5 ] || failed+=("GPU test tier (pytest exit $rc)")

echo "== 2/3 grpo.py, 3 steps, colocated on one GPU, built-in model"
"$PYTHON" grpo.py --colocate --num-steps 3 --output-dir "$out/smoke" || failed+=("colocated grpo.py smoke run")

echo "== 3/3 reference benchmark"
model=$("$PYTHON" -c "import sys; sys.path.insert(0, '.')
from benchmark.random_model import make_random_model
print(make_random_model('qwen2.5-0.5b', '$out/qwen2.5-0.5b-random'))" | tail -1)
bench() {  # name, then flags of $SCRIPT (default grpo.py); GPU memory is polled every 0.5 s while it runs
  local name=$1 script=${SCRIPT:-grpo.py}
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$out/$name.memory.log" &
  local poller=$!
  "$PYTHON" "$script" --model "$model" --exp-name "$name" --output-dir "$out/$name" --num-steps "$steps" \
    --prompts-per-step 64 --num-generations 8 --max-response-length 512 --gradient-checkpointing \
    --max-tokens-per-micro-batch 16384 --eval-dataset "" --learning-rate 1e-6 --warmup-steps 0 "$@"
  local rc=$?
  kill $poller 2>/dev/null
  [ $rc -eq 0 ] || failed+=("benchmark $name (exit $rc)")
  return $rc
}
if bench colocated --colocate; then
  "$PYTHON" benchmark/gpu_report.py "$out"/colocated/colocated__* --memory "$out/colocated.memory.log"
fi
if [ "$gpus" -ge 2 ] && bench split --num-trainers 1 --num-engines 1; then
  "$PYTHON" benchmark/gpu_report.py "$out"/split/split__* --memory "$out/split.memory.log"
  # grpo_async.py on the same two GPUs and batch; its target is relative to the split run above
  if SCRIPT=grpo_async.py bench async --num-trainers 1 --num-engines 1; then
    "$PYTHON" benchmark/gpu_report.py "$out"/split/split__* "$out"/async/async__* --memory "$out/async.memory.log"
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all GPU checks passed; runs and logs in $out"
