#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds the native libraries (CPU + CUDA)
# in place, runs the GPU tests (plus the CPU op and build tests), the kernel benchmark on
# the GPU and a quick one on the CPU, and writes everything under OUTDIR:
#   env.txt  build.log  pytest.txt  bench_gpu.json  bench_cpu.json  bench.log
#   memcheck.txt  summary.txt        (8 files at most, so a copy-back limit of 8 keeps all)
# Needs python3 with torch (CUDA build), numpy, pytest, hypothesis; nvcc on PATH or in
# CUDA_HOME. Each step has its own timeout; the whole run takes a few minutes.
# Usage: benchmarks/gpu_check.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
declare -A RC

step() {  # step NAME TIMEOUT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  RC[$name]=$?
  echo "$name: rc=${RC[$name]} ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
}

: >"$OUT/summary.txt"
: >"$OUT/bench.log"
{ nvidia-smi; command -v nvcc && nvcc --version
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$OUT/env.txt" 2>&1

step build 300 "$OUT/build.log" "$PY" -c '
import time
from pathlib import Path
from sglang_kvxfer import envs, _native
from sglang_kvxfer._native import build
pkg = Path("sglang_kvxfer/_native")
t0 = time.monotonic(); build.build_cpu(pkg / build.CPU_LIBRARY)
t1 = time.monotonic(); build.build_cuda(pkg / build.CUDA_LIBRARY, envs.KVXFER_CUDA_ARCHS.get().split(","))
t2 = time.monotonic()
print(f"cpu build {t1 - t0:.1f} s, cuda build {t2 - t1:.1f} s")
status = _native.status()
print(status)
raise SystemExit(0 if status["cuda"].startswith("loaded") else 1)
'

step pytest 420 "$OUT/pytest.txt" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/ops/test_ops_gpu.py tests/ops/test_ops.py \
  tests/ops/test_ops_errors.py tests/native/test_csrc_build.py

step bench_gpu 300 "$OUT/bench.log" sh -c \
  "'$PY' benchmarks/bench_kernels.py --device cuda > '$OUT/bench_gpu.json'"

step bench_cpu 180 "$OUT/bench.log" sh -c \
  "'$PY' benchmarks/bench_kernels.py --device cpu --quick > '$OUT/bench_cpu.json'"

# Out-of-bounds check of the kernels, where the runtime lets compute-sanitizer run
# (informational: its absence or refusal does not fail the check).
if command -v compute-sanitizer >/dev/null; then
  step memcheck 240 "$OUT/memcheck.txt" compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_ops_gpu.py -k "vector_width or many_layers"
fi

"$PY" - "$OUT/bench_gpu.json" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as exc:  # the benchmark failed: its log says why
    print(f"no GPU benchmark results: {exc}")
    raise SystemExit(0)
print("GPU page16 dim128:", json.dumps(doc.get("summary_page16_dim128")))
PYEOF
[[ ${RC[build]} -eq 0 && ${RC[pytest]} -eq 0 && ${RC[bench_gpu]} -eq 0 ]]
