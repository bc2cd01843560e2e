#!/usr/bin/env bash
# One prepared check for a machine with NVIDIA GPUs, runnable the moment one is lent (about ten minutes):
#
#   tools/gpu_check.sh             # on the GPU machine, from anywhere in the repository
#   tools/gpu_check.sh --dry-run   # anywhere (CPU): print what would run, check every file and module exists
#
# Steps (each under its own time limit; a failed or skipped step does not stop the others):
#   env       GPUs, driver, torch/CUDA/NCCL, bf16, megatron-core, Transformer Engine, vLLM
#   install   the project without touching the machine's torch (--no-deps), and megatron-core/psutil
#             only if missing and an index is reachable
#   gpu       the gpu-marked tests (pytest -m gpu)
#   nccl      an NCCL all-reduce and a bf16 matmul on every GPU (runtime/engines/launch.py)
#   parity    FSDP2 and Megatron parity tests (4 ranks: on GPUs when there are 4, else on CPU, said so)
#   rollout   the native engine and vLLM rollout tests, and the rollout benchmark on cuda
#   reshard   the reshard benchmark (bytes against the Table 2 formula)
# then a one-page summary. Logs and JSON figures go to $OUT (default: a fresh temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-$(mktemp -d -t hflow-gpu-check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python}
START=$(date +%s)
BUDGET=${BUDGET:-570}  # seconds for all steps; the summary comes after
declare -a NAMES=() STATUS=() SECS=() NOTES=()

log() { printf '%s\n' "$*" | tee -a "$OUT/gpu_check.log"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT CMD...: run CMD under min(LIMIT, time left), output to $OUT/NAME.log; record the outcome.
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc=0 lim
    lim=$(left)
    ((lim > limit)) && lim=$limit
    if ((DRY)); then
        log "[dry-run] $name (<= ${limit}s): $*"
        NAMES+=("$name"); STATUS+=("DRY"); SECS+=(0); NOTES+=("would run (command above)")
        return 0
    fi
    if ((lim < 10)); then
        NAMES+=("$name"); STATUS+=("SKIP"); SECS+=(0); NOTES+=("out of time")
        return 0
    fi
    log "== $name (<= ${lim}s): $*"
    t0=$(date +%s)
    timeout "$lim" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local status=PASS
    ((rc == 124)) && status=TIMEOUT
    ((rc != 0 && rc != 124)) && status=FAIL
    # pytest: 5 = nothing collected (e.g. no gpu-marked tests yet)
    [[ " $* " == *" -m pytest "* && $rc == 5 ]] && status=NONE
    NAMES+=("$name"); STATUS+=("$status"); SECS+=($(($(date +%s) - t0)))
    NOTES+=("$(grep -E 'passed|failed|skipped|error|Error|MiB|tok/s|tokens/s' "$OUT/$name.log" | tail -1 | cut -c1-90)")
}

skip() { NAMES+=("$1"); STATUS+=("SKIP"); SECS+=(0); NOTES+=("$2"); log "-- $1 skipped: $2"; }

# ---- what must exist (checked in both modes) ----------------------------------------------------
missing=0
for f in tests/runtime/engines/train/test_megatron_engine.py tests/runtime/engines/train/test_parallel_training.py \
         tests/runtime/engines/rollout/test_generation.py tests/runtime/engines/rollout/test_vllm_rollout.py \
         tools/bench/rollout_speed.py tools/bench/reshard_speed.py runtime/engines/launch.py; do
    [[ -f $f ]] || { log "missing $f"; missing=1; }
done
for c in "$PY" timeout; do
    command -v "$c" >/dev/null || { log "missing command $c"; missing=1; }
done
((missing)) && { log "gpu_check: the repository or machine lacks what the steps need (above)"; exit 2; }

# ---- env ----------------------------------------------------------------------------------------
NGPU=0
if command -v nvidia-smi >/dev/null; then
    NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.csv" 2>&1
elif ((!DRY)); then
    log "gpu_check: no nvidia-smi here; run it on a machine with NVIDIA GPUs (or --dry-run)"
    exit 2
fi
ENV_PY='
import importlib.util as u, json, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    d |= {"name": torch.cuda.get_device_name(0), "bf16": torch.cuda.is_bf16_supported(),
          "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
for m in ("megatron.core", "transformer_engine", "vllm", "ray"):
    d[m] = bool(u.find_spec(m.split(".")[0]) and u.find_spec(m))
print(json.dumps(d))'

# ---- steps --------------------------------------------------------------------------------------
has() { "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)" 2>/dev/null; }

step install 150 bash -c "$PY -m pip install -q --no-deps -e . && \
    { $PY -c 'import megatron.core, psutil' 2>/dev/null || \
      timeout 60 $PY -m pip install -q 'megatron-core==0.16.1' 'psutil>=5.9' || \
      echo 'megatron-core not installable here (no index?): its tests will skip'; }"
step env 60 "$PY" -c "$ENV_PY"
step gpu 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider
if ((NGPU >= 2 || DRY)); then
    # fork: the check's function lives in this -c program, which a forkserver child cannot import
    step nccl 90 env HFLOW_START_METHOD=fork "$PY" -c "
import torch, torch.distributed as dist
from hybridflow.runtime.engines.launch import run_local
def f(rank, world):
    x = torch.ones(1 << 20, device='cuda') * (rank + 1)
    dist.all_reduce(x)
    a = torch.randn(1024, 1024, device='cuda', dtype=torch.bfloat16)
    return float(x[0]), float((a @ a).float().abs().mean())
n = torch.cuda.device_count()
out = run_local(f, n, timeout=80)
assert all(s == n * (n + 1) / 2 for s, _ in out), out
print(f'nccl all-reduce on {n} GPUs ok; bf16 matmul ok')"
else
    skip nccl "one GPU: no NCCL group to form"
fi
if ((NGPU >= 4 || DRY)); then
    step parity 200 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/engines/train/test_megatron_engine.py \
        tests/runtime/engines/train/test_parallel_training.py
else
    # 4 ranks cannot share fewer GPUs under NCCL: the same tests on CPU (gloo), which says the
    # installed megatron-core and torch agree; GPU parity needs a 4-GPU machine.
    step parity 200 env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -p no:cacheprovider \
        tests/runtime/engines/train/test_megatron_engine.py tests/runtime/engines/train/test_parallel_training.py
    NOTES[-1]="(on CPU: $NGPU GPU) ${NOTES[-1]}"
fi
step rollout_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/engines/rollout/test_generation.py \
    tests/runtime/engines/rollout/test_vllm_rollout.py
VLLM_FLAG=""
has vllm && VLLM_FLAG="--vllm"
step rollout_bench 120 "$PY" -m hybridflow.tools.bench.rollout_speed --device cuda --batch 1,16 \
    --new-tokens 64 --repeats 3 --json "$OUT/rollout.json" $VLLM_FLAG
step reshard_bench 90 "$PY" -m hybridflow.tools.bench.reshard_speed --t 4 --t-g 2 --repeats 2 \
    --json "$OUT/reshard.json"

# ---- summary ------------------------------------------------------------------------------------
{
    echo
    echo "hybridflow GPU check — $(date -u +%FT%TZ) — ${NGPU} GPU(s) — $(($(date +%s) - START))s — logs: $OUT"
    [[ -f $OUT/nvidia-smi.csv ]] && sed 's/^/  /' "$OUT/nvidia-smi.csv"
    ((DRY)) || { [[ -f $OUT/env.log ]] && echo "  env: $(tail -1 "$OUT/env.log")"; }
    printf '  %-14s %-8s %6s  %s\n' step status sec note
    for i in "${!NAMES[@]}"; do
        printf '  %-14s %-8s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
    done
} | tee -a "$OUT/gpu_check.log"
for s in "${STATUS[@]}"; do
    [[ $s == FAIL || $s == TIMEOUT ]] && exit 1
done
exit 0
