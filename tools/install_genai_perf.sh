#!/usr/bin/env bash
# Sets up genai-perf + the perf_analyzer C++ binary in a venv of their own (not the project's .venv:
# genai-perf pulls pandas, plotly, pyarrow, statsmodels, kaleido, ...), for tools/genai_perf_bench.py.
#
#   bash tools/install_genai_perf.sh [VENV]      # default /work/gp-venv
#
# Why these versions (Debian 12, glibc 2.36):
#   * the `perf-analyzer` pip package (0.1.0) is a placeholder without the C++ binary; the binary ships inside the
#     tritonclient manylinux wheels (tritonclient-X.data/data/bin/perf_analyzer, which pip installs to VENV/bin).
#   * tritonclient 2.52.0 and newer build perf_analyzer against GLIBC_2.38: it does not load here.
#     2.51.0 (Triton 24.10) needs GLIBC_2.34 at most: the newest that runs (2.50/2.49/2.48 also load).
#     It has --service-kind openai (--endpoint v1/chat/completions, v1/completions) and triton (grpc --streaming),
#     --request-count and --warmup-request-count (not listed in --help, but accepted).
#   * genai-perf 0.0.9 is the pinned CLI: the first with --request-count (0.0.8 lacks it), still with
#     --service-kind, and its TensorRT-LLM input format sends only text_input, max_tokens, stream (plus
#     min_length with --output-tokens-mean-deterministic), which specexport's Triton model accepts today.
#     genai-perf 0.0.16 (the newest) also drives this perf_analyzer (checked: OpenAI chat and completions
#     work), but from 0.0.14 on its TensorRT-LLM format always sends exclude_input_in_output, an input the
#     specexport model does not declare yet, so perf_analyzer stops with "Failed to init manager inputs: The
#     input or output 'exclude_input_in_output' is not found in the model configuration".
#     GENAI_PERF_VERSION=0.0.16 bash tools/install_genai_perf.sh DIR installs that one instead.
#   * perf_analyzer 2.51 links libb64.so.0d (Debian package libb64-0d, fetched with `apt-get download` and
#     unpacked into the venv, no root needed) and libcudart.so.12 (pip nvidia-cuda-runtime-cu12, loaded but
#     unused on CPU); a small wrapper VENV/bin/perf_analyzer puts both on LD_LIBRARY_PATH and runs the real
#     binary, VENV/libexec/perf_analyzer. genai-perf finds perf_analyzer on PATH (genai_perf_bench.py puts
#     the genai-perf folder first on PATH).
set -euo pipefail

VENV="${1:-/work/gp-venv}"
GENAI_PERF_VERSION="${GENAI_PERF_VERSION:-0.0.9}"
TRITONCLIENT_VERSION="${TRITONCLIENT_VERSION:-2.51.0}"

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# transformers stays unpinned (5.x): engine tokenizer folders written by transformers 5 name the
# tokenizer class "TokenizersBackend", which transformers 4 cannot load.
"$VENV/bin/pip" install -q "genai-perf==$GENAI_PERF_VERSION" "tritonclient[all]==$TRITONCLIENT_VERSION" \
    "nvidia-cuda-runtime-cu12"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# the binary: take it from the wheel itself (pip's copy in VENV/bin may have been replaced by a wrapper already)
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    "tritonclient==$TRITONCLIENT_VERSION" -d "$tmp/whl"
(cd "$tmp" && python3 -m zipfile -e whl/tritonclient-*.whl x >/dev/null)
mkdir -p "$VENV/libexec" "$VENV/lib/pa"
install -m 755 "$tmp"/x/tritonclient-*.data/data/bin/perf_analyzer "$VENV/libexec/perf_analyzer"
rm -f "$VENV/bin/perf_client"

(cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1 && dpkg -x libb64-0d_*.deb b64)
cp "$tmp"/b64/usr/lib/x86_64-linux-gnu/libb64.so.0d "$VENV/lib/pa/"

cat > "$VENV/bin/perf_analyzer" <<'EOF'
#!/bin/sh
here="$(cd "$(dirname "$0")/.." && pwd)"
cudart="$(echo "$here"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)"
export LD_LIBRARY_PATH="$here/lib/pa:$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/libexec/perf_analyzer" "$@"
EOF
chmod 755 "$VENV/bin/perf_analyzer"

if LD_LIBRARY_PATH="$VENV/lib/pa:$(echo "$VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)" \
     ldd "$VENV/libexec/perf_analyzer" | grep "not found"; then
    echo "perf_analyzer has unresolved libraries" >&2; exit 1
fi
help="$("$VENV/bin/perf_analyzer" --help 2>&1 || true)"   # --help exits non-zero
case "$help" in *--service-kind*) ;; *) echo "perf_analyzer does not run: $help" >&2; exit 1 ;; esac
"$VENV/bin/genai-perf" --version 2>/dev/null || "$VENV/bin/pip" show genai-perf | head -2
echo "genai-perf $GENAI_PERF_VERSION + perf_analyzer (tritonclient $TRITONCLIENT_VERSION) in $VENV"
