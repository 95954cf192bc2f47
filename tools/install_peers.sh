#!/usr/bin/env bash
# The benchmark peers for `specexport bench --peers llama.cpp,ort-genai` (not needed by the tests, which skip
# without them). llama-cpp-python ships only an sdist: about 6-10 minutes of compiling on 2 cores. Its default
# -march=native build crashed at the first decode on a CPU with AMX (ggml's AMX path), so the CPU features are
# spelled out from /proc/cpuinfo (an instruction set the CPU lacks would stop the first decode just the same) and
# AMX is off.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q -e ".[peers]"
# the flags: specexport.bench.peers.llama_cpp_cmake_args (the CPU's instruction sets from /proc/cpuinfo, AMX off)
CMAKE_ARGS="$(.venv/bin/python -c 'from specexport.bench.peers import llama_cpp_cmake_args as f; print(f())')" \
MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36
