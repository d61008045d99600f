#!/usr/bin/env bash
# Build the Python environment the real-server tests and examples/sglang_cpu_pd run SGLang
# 0.5.23 from, on a CPU-only machine: CPU torch 2.13.0, SGLang without its dependencies
# (they pin a CUDA torch 2.14.1, triton and CUDA kernel wheels), SGLang's non-CUDA
# dependencies, and this project (editable, so the tests exercise this checkout).
#
#   tests/realserver/make_env.sh [VENV]     # default: $KVXFER_SGLANG_VENV or ~/.cache/kvxfer/sglang-0.5.23
#
# Idempotent: a finished environment carries a stamp with this recipe's hash and is only
# re-pointed at this checkout. About 3 minutes and 3 GB on a fresh machine.
# What SGLang still lacks on a CPU (sgl_kernel, torchvision) is not installed: the tests put
# labelled stand-ins on PYTHONPATH (tests/realserver/standins/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-${KVXFER_SGLANG_VENV:-$HOME/.cache/kvxfer/sglang-0.5.23}}"
base="${PYTHON:-python3.11}"
command -v "$base" >/dev/null || base=python3
recipe_hash="$(sha256sum "$0" | cut -c1-16)"
stamp="$venv/.kvxfer-recipe"

if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$recipe_hash" ]]; then
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$root"
    echo "sglang environment: $venv (ready)"
    exit 0
fi
echo "sglang environment: building $venv" >&2
rm -rf "$venv"
"$base" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: the CPU wheel (an unpinned torch is a multi-GB CUDA build)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps sglang==0.5.23
# SGLang's dependencies that run on a CPU (pins as sglang 0.5.23 declares them). Left out:
# CUDA kernels and wheels (sglang-kernel, flashinfer, flash-attn, deep-ep/gemm, cutlass,
# nvshmem, cuda-python, tilelang, quack, humming), torchvision/torchaudio/torchcodec (the
# registry's builds are CUDA-linked) and timm (needs torchvision).
"${pip[@]}" torch==2.13.0 \
    aiohttp anthropic "apache-tvm-ffi==0.1.11" "blobfile==3.0.0" build "compressed-tensors==0.18.0" \
    datasets distro easydict einops fastapi gguf interegular ipython "llguidance>=1.7.6,<2" \
    "mistral_common>=1.11.5" msgpack msgspec ninja numpy "openai==2.8.0" "openai-harmony==0.0.4" \
    orjson "outlines==0.1.11" packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil \
    pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy \
    "sentencepiece==0.2.1" setproctitle "soundfile==0.13.1" tiktoken "tokenizers==0.23.2" tqdm \
    "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard
"${pip[@]}" --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -c "import sglang, torch, sglang_kvxfer; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$recipe_hash" > "$stamp"
echo "sglang environment: $venv (built)"
