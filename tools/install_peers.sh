#!/usr/bin/env bash
# The benchmark peers for `specexport bench --peers llama.cpp,ort-genai` (not needed by the tests, which skip
# without them). llama-cpp-python ships only an sdist: about 6-10 minutes of compiling on 2 cores. Its default
# -march=native build crashed at the first decode on this project's CPU (ggml's AMX path), so the CPU features
# are spelled out and AMX is off.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q -e ".[peers]"
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_FMA=ON \
-DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" \
MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36
