#!/usr/bin/env bash
# The GPU check: one time-bounded run on a machine with an NVIDIA GPU and no package
# registry (docs/benchmarks.md#the-gpu-check). In priority order, each step under its own
# `timeout` and all of them inside a budget (GPU_CHECK_BUDGET_S, default 450 s):
#   1. wheels carried in .whl/ (pyzmq, nixl-cu13) into /tmp/site; the project installed
#      with --no-build-isolation (native CPU + CUDA libraries built), native-backend check
#   2. the GPU tests (CUDA kernels, copy stream, CUDA IPC, tcp from GPU pools, ...)
#   3. kernel-alone bandwidth against a device copy: page 16, head_dim 128, bf16, 1-8 of 8
#      heads, NHD and HND; then the fused pool -> pool copy against gather + scatter
#   4. compute-sanitizer memcheck of a small gather/scatter run
#   5. `kvxfer bench` with GPU pools over `local`: direct, staged, NHD->HND, MLA
#   6. `kvxfer bench` over `nixl` with VRAM pools
# Everything lands in OUT (at most 8 files): summary.json (every step's status, seconds
# and reason; the key figures), env.log, build.log, pytest.log, kernels.json, fused.json,
# memcheck.log, bench.log. A step that cannot run here is skipped with its reason; none can hang.
# Usage: OUT=dir benchmarks/gpu_check.sh   (or benchmarks/gpu_check.sh dir)
set -uo pipefail
OUT=${1:-${OUT:-}}
if [[ -z $OUT ]]; then
  echo "usage: OUT=dir $0  (or $0 dir)" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
T0=$SECONDS
WORK=$(mktemp -d /tmp/gpucheck.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.tsv
: >"$STEPS"
for f in env.log build.log pytest.log memcheck.log bench.log; do : >"$OUT/$f"; done
rm -f "$OUT/kernels.json" "$OUT/fused.json" "$OUT/summary.json"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

left() { echo $((BUDGET_S - (SECONDS - T0))); }

record() { # NAME STATUS SECONDS REASON
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >>"$STEPS"
  echo "[gpu_check $((SECONDS - T0)) s] $1: $2 ($3 s) $4" | tee -a "$OUT/env.log" >&2
}

skip() { record "$1" skip 0 "$2"; }

# step NAME LIMIT_S LOG CMD...: runs CMD under `timeout` (capped by the budget left),
# appends its output to LOG, records ok / fail / timeout / skip (exit 77: the last line of
# its output is the reason) and returns its exit status.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local rest
  rest=$(left)
  if ((rest < 20)); then
    skip "$name" "no time left in the ${BUDGET_S} s budget"
    return 125
  fi
  ((limit > rest - 10)) && limit=$((rest - 10))
  echo "=== $name (limit $limit s): $*" >>"$log"
  local t=$SECONDS rc
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local status=ok reason=""
  if ((rc == 124 || rc == 137)); then
    status=timeout reason="killed after $limit s (see $(basename "$log"))"
  elif ((rc == 77)); then
    status=skip reason=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-300)
  elif ((rc != 0)); then
    status=fail reason="exit $rc: $(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-300)"
  fi
  record "$name" "$status" $((SECONDS - t)) "$reason"
  return $rc
}

# -- 0. what this machine is ----------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  budget: $BUDGET_S s"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi: not available"
  command -v nvcc && timeout 20 nvcc --version | tail -n 2
  timeout 60 "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count() if torch.cuda.is_available() else 0)"
} >>"$OUT/env.log" 2>&1
GPU_REASON=""
if ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  GPU_REASON="torch sees no CUDA device"
fi

# -- 1. wheels, install, native backend -----------------------------------------------------
shopt -s nullglob
WHEELS=(.whl/*.whl)
shopt -u nullglob
if ((${#WHEELS[@]})); then
  if step wheels 90 "$OUT/env.log" "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS[@]}"; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  skip wheels "no .whl/*.whl carried (pyzmq, nixl-cu13); using what is installed"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} # the checkout, even if the install fails

KVXFER_BUILD_CUDA=$([[ -z $GPU_REASON ]] && echo 1 || echo auto) \
  step install 240 "$OUT/build.log" "$PY" -m pip install -v --no-build-isolation --no-deps -e .

read -r -d '' NATIVE_PY <<'EOF'
import json, subprocess, sys
import torch
from sglang_kvxfer import _native, ops
from sglang_kvxfer._native import build
tc = build.cuda_toolchain()
status = _native.status()
doc = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "toolchain": tc.describe() if tc else None, "status": status}
lib = _native.cuda_library()
if lib is not None:
    out = subprocess.run(["readelf", "-d", str(lib.path)], capture_output=True, text=True).stdout
    doc["needed"] = [l.split("[")[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l]
doc["backend"] = ops.backend_for("cuda") if torch.cuda.is_available() else None
print("NATIVE_JSON " + json.dumps(doc))
if not torch.cuda.is_available():
    print("skip: torch sees no CUDA device; the CUDA library is " + status["cuda"])
    sys.exit(77)
sys.exit(0 if doc["backend"] == "native-cuda" else 1)
EOF
step native 90 "$OUT/build.log" "$PY" -c "$NATIVE_PY"

# -- 2. GPU tests (they skip themselves without a device) -----------------------------------
TESTS=()
for t in tests/ops/test_ops_gpu.py tests/ops/test_ops_copy.py tests/ops/test_ops_checked_layers.py \
  tests/transports/test_local_cuda.py tests/transports/test_local_cuda_peers.py tests/transports/test_tcp_cuda.py \
  tests/engine/test_engine_hooks.py; do
  [[ -f $t ]] && TESTS+=("$t")
done
step pytest 180 "$OUT/pytest.log" "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}"

# -- 3. kernel alone vs device copy ---------------------------------------------------------
if [[ -n $GPU_REASON ]]; then
  skip kernels "$GPU_REASON"
else
  step kernels 120 "$OUT/bench.log" sh -c "'$PY' benchmarks/bench_kernels.py --device cuda --dtype bf16 \
    --layouts NHD,HND --head-dims 128 --page-sizes 16 --heads 1,2,4,8 --pool-heads 8 --layers 4 \
    --staging-mib 256 --repeats 7 > '$OUT/kernels.json'"
  step fused 120 "$OUT/bench.log" sh -c "'$PY' benchmarks/bench_kernels.py --device cuda --dtype bf16 --fused \
    --repeats 7 > '$OUT/fused.json'"
fi

# -- 4. compute-sanitizer memcheck of a small run -------------------------------------------
cat >"$WORK/small.py" <<'EOF'
import torch
from sglang_kvxfer import ops
gen = torch.Generator().manual_seed(0)
for layout in ("NHD", "HND"):
    shape = (16 * 8, 8, 128) if layout == "NHD" else (16, 8, 8, 128)
    k = [torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen).to("cuda") for _ in range(2)]
    v = [t.clone() for t in k]
    kw = dict(page_size=8, head_start=3, num_heads=3, layout=layout, token_offset=5, num_tokens=100)
    pages = torch.randperm(16, generator=gen).tolist()
    staging = ops.gather_kv_heads(k, v, pages, **kw)
    dk, dv = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
    ops.scatter_kv_heads(staging, dk, dv, pages, **kw)
    torch.cuda.synchronize()
    ref = ops.gather_kv_heads_reference([t.cpu() for t in k], [t.cpu() for t in v], pages, **kw)
    assert torch.equal(staging.cpu(), ref), layout
    assert torch.equal(ops.gather_kv_heads(dk, dv, pages, **kw).cpu(), ref), layout
assert ops.backend_for("cuda") == "native-cuda", ops.backend_for("cuda")
print("small run ok")
EOF
SANITIZERS=()
for cs in "$(command -v compute-sanitizer 2>/dev/null)" ${CUDA_HOME:+$CUDA_HOME/bin/compute-sanitizer} \
  /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  [[ -n $cs && -x $cs ]] && [[ " ${SANITIZERS[*]-} " != *" $(readlink -f "$cs") "* ]] && SANITIZERS+=("$(readlink -f "$cs")")
done
if [[ -n $GPU_REASON ]]; then
  skip memcheck "$GPU_REASON"
elif ((${#SANITIZERS[@]} == 0)); then
  skip memcheck "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*)"
else
  # One runtime refuses memcheck on some machines: try each sanitizer until one runs.
  for cs in "${SANITIZERS[@]}"; do
    step memcheck 100 "$OUT/memcheck.log" "$cs" --tool memcheck --error-exitcode 9 "$PY" "$WORK/small.py"
    rc=$?
    ((rc == 0 || rc == 9 || rc == 124 || rc == 125 || rc == 137)) && break
  done
fi

# -- 5./6. kvxfer bench with GPU pools ------------------------------------------------------
BENCH=(-m sglang_kvxfer bench --tokens 4096 --requests 4 --repeats 1 --concurrency 2 --layers 8 --json --quiet
  --prefill-devices cuda:0,cuda:0 --decode-devices cuda:0 --bootstrap-timeout 30 --transfer-timeout 30)
if [[ -n $GPU_REASON ]]; then
  skip bench_local "$GPU_REASON"
  skip bench_local_mla "$GPU_REASON"
  skip bench_nixl "$GPU_REASON"
else
  # TP 1->1 NHD->NHD: direct; 1->1 NHD->HND, 2->1 NHD->NHD, 2->1 NHD->HND: staged
  step bench_local 150 "$OUT/bench.log" "$PY" "${BENCH[@]}" --transport local --prefill-tp 1,2 --decode-tp 1 \
    --prefill-layout NHD --decode-layout NHD,HND --output "$WORK/bench_local.json"
  step bench_local_mla 60 "$OUT/bench.log" "$PY" "${BENCH[@]}" --transport local --mla --head-dim 576 \
    --prefill-tp 2 --decode-tp 1 --output "$WORK/bench_local_mla.json"
  if step nixl_available 30 "$OUT/bench.log" "$PY" -c "import sys
from sglang_kvxfer.transports import available_transports
sys.exit(0) if 'nixl' in available_transports() else print('skip: nixl is not importable (carry the nixl-cu13 wheel in .whl/)') or sys.exit(77)"; then
    step bench_nixl 90 "$OUT/bench.log" "$PY" "${BENCH[@]}" --transport nixl --prefill-tp 1,2 --decode-tp 1 \
      --output "$WORK/bench_nixl.json"
  fi
fi

# -- summary --------------------------------------------------------------------------------
read -r -d '' SUMMARY_PY <<'EOF'
import json, os, sys
out, work, elapsed, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps = []
for line in open(os.path.join(work, "steps.tsv")):
    name, status, seconds, reason = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    steps.append({"step": name, "status": status, "seconds": int(seconds), "reason": reason})
doc = {"elapsed_s": elapsed, "budget_s": budget, "steps": steps}
for line in open(os.path.join(out, "build.log"), errors="replace"):
    if line.startswith("NATIVE_JSON "):
        doc["native"] = json.loads(line[len("NATIVE_JSON "):])
tail = [l.strip() for l in open(os.path.join(out, "pytest.log"), errors="replace") if l.strip()]
doc["pytest"] = tail[-1] if tail else None
try:
    kernels = json.load(open(os.path.join(out, "kernels.json")))
    doc["kernels"] = {
        "device_name": kernels.get("device_name"),
        "summary_page16_dim128": kernels.get("summary_page16_dim128"),
        "configs": [{k: r.get(k) for k in ("layout", "num_heads", "copy_gbps", "gather_ratio", "scatter_ratio",
                                              "gather_kernel_ratio", "scatter_kernel_ratio")}
                    for r in kernels.get("results", [])],
    }
except (OSError, ValueError) as exc:
    doc["kernels"] = {"error": f"no kernel results: {exc}"}
try:
    doc["fused"] = json.load(open(os.path.join(out, "fused.json")))
except (OSError, ValueError) as exc:
    doc["fused"] = {"error": f"no fused-copy results: {exc}"}
bench = {}
for name in ("bench_local", "bench_local_mla", "bench_nixl"):
    try:
        records = json.load(open(os.path.join(work, name + ".json")))["records"]
    except (OSError, ValueError, KeyError):
        continue
    bench[name] = [{k: r.get(k) for k in ("prefill_tp", "decode_tp", "prefill_layout", "decode_layout", "mla",
                                           "data_path", "gbps", "ratio", "latency_ms", "succeeded_requests",
                                           "verified_requests", "failures")} for r in records]
doc["bench"] = bench
doc["ok"] = all(s["status"] == "ok" for s in steps if s["step"] in ("install", "native", "pytest", "kernels"))
json.dump(doc, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({s["step"]: s["status"] for s in steps}))
sys.exit(0 if doc["ok"] else 1)
EOF
timeout 60 "$PY" -c "$SUMMARY_PY" "$OUT" "$WORK" $((SECONDS - T0)) "$BUDGET_S"
