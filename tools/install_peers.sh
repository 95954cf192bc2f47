#!/usr/bin/env bash
# The benchmark peers for `specexport bench --peers llama.cpp,ort-genai` (not needed by the tests, which skip
# without them). llama-cpp-python ships only an sdist: about 6-10 minutes of compiling on 2 cores. Its default
# -march=native build crashed at the first decode on a CPU with AMX (ggml's AMX path), so the CPU features are
# spelled out from /proc/cpuinfo (an instruction set the CPU lacks would stop the first decode just the same) and
# AMX is off.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q -e ".[peers]"
has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_BMI2=$(has bmi2) \
-DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX_VNNI=$(has avx_vnni) \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" \
MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36
