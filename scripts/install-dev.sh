#!/usr/bin/env bash
# Install asyncflow with its test extras and the deepspeed engine into ./.venv (CPU torch from the
# local wheel first, so no CUDA build is pulled in), and Graphviz for the pictures where we can.
# The vllm engine has a venv of its own: scripts/install-vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "warning: could not install graphviz; picture tests will be skipped"
  else
    echo "warning: graphviz (dot) is not installed; picture tests will be skipped"
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev,hf,ray]'
# the deepspeed trainer engine, CPU (gloo): built from source without its ops and without build
# isolation, so it keeps the CPU torch above (tested with 0.19.8)
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation 'deepspeed==0.19.*'
