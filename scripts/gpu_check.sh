#!/usr/bin/env bash
# The memory promise on a real GPU, as one prepared script (one H200, under 8 minutes from a bare
# machine). It needs a Python with the CUDA torch (the GPU machine's image has one; PYTHON=... picks
# another); the project's pure-Python dependencies it cannot find are installed from wheels carried
# in .whl/ (pip download them here, see docs/concepts/architecture.md "Memory"), never from the network.
#   0. environment: torch, CUDA, NVML, redis-server;
#   1. one minilm worker (make up MODEL=minilm GPUS=0 WORKERS_PER_GPU=1): 500 concurrent requests, one
#      in 8 at the model's maximum length, then per worker NVML's per-process used memory vs
#      share x total, max reserved vs the allocator cap, the plan's numbers, OOM events, lost requests;
#   2. three minilm workers on GPU 0 whose shares add up to the watermark: the same checks;
#   3. one of the three SIGKILLed under load and restarted by supervisor: no request lost, and the
#      same checks once it is back;
#   4. the calibration table: per shipped model and batch size, the simulated GPU's prediction (the
#      model on the CPU, its allocations mirrored) beside CUDA's max_memory_reserved and NVML's
#      per-process figure (a table to read, not a check).
# Prints PASS/FAIL per check and "gpu_check: PASS" or "gpu_check: FAIL" last; exits 1 on any FAIL.
# Usage: scripts/gpu_check.sh   (PYTHON=..., PORT=8765, REDIS_PORT=6391, N=500 override)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
PORT=${PORT:-8765}
REDIS_PORT=${REDIS_PORT:-6391}
N=${N:-500}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
FAILED=0
fail() { echo "FAIL  $*"; FAILED=1; }
started=$(date +%s)

echo "== 0. environment"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || fail "installing the carried wheels"
else
    export PYTHONPATH=$PWD
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
p = torch.cuda.get_device_properties(0); print(torch.__version__, p.name, p.total_memory, 'bytes')" || { fail "no CUDA torch"; exit 1; }
"$PY" -c "import pynvml; pynvml.nvmlInit(); print('NVML', pynvml.nvmlSystemGetDriverVersion())" || fail "NVML (pynvml) missing"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true

# run_stack LABEL WORKERS: deploy/up.py with WORKERS minilm workers on GPU 0; waits for readiness
# and leaves it running (UP_PID); its logs are in .run/$PORT/.
run_stack() {
    echo "== $1"
    RUN_LOG=$(mktemp)
    env VRAMGUARD_PORT=$PORT VRAMGUARD_REDIS_PORT=$REDIS_PORT VRAMGUARD_DEVICE=cuda \
        VRAMGUARD_MODELS__MINILM__MAX_WAIT_MS=10 "$PY" deploy/up.py --run-dir .run/$PORT --model minilm --gpus 0 \
        --workers-per-gpu "$2" >"$RUN_LOG" 2>&1 &
    UP_PID=$!
    for _ in $(seq 1 150); do
        grep -q "vramguard is ready" "$RUN_LOG" && break
        kill -0 $UP_PID 2>/dev/null || break
        sleep 1
    done
    if ! grep -q "vramguard is ready" "$RUN_LOG"; then
        fail "$1: stack not ready"; tail -n 40 "$RUN_LOG"; tail -n 30 .run/$PORT/worker-*.log; return 1
    fi
    grep -h '"memory plan"' .run/$PORT/worker-*.log | tail -n "$2" || true
}
stop_stack() { kill -TERM $UP_PID 2>/dev/null || true; wait $UP_PID 2>/dev/null || true; }
trap stop_stack EXIT
check() {  # check WORKERS: the load, then the per-worker memory checks
    timeout 240 "$PY" scripts/gpu_check.py load --url "http://127.0.0.1:$PORT" --model minilm -n "$N" || FAILED=1
    sleep 2  # one more heartbeat carries the final counters
    timeout 60 "$PY" scripts/gpu_check.py report --url "http://127.0.0.1:$PORT" --model minilm --workers "$1" \
        || FAILED=1
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
}

if run_stack "1. one minilm worker" 1; then check 1; fi
stop_stack

if run_stack "2. three minilm workers on GPU 0, shares adding up to the watermark" 3; then
    check 3
    echo "== 3. one of the three SIGKILLed under load; supervisor restarts it"
    victim=$(grep -ho "spawned: 'worker-minilm-gpu0-0' with pid [0-9]*" .run/$PORT/supervisord.log | tail -n 1 \
        | awk '{print $NF}')
    timeout 240 "$PY" scripts/gpu_check.py load --url "http://127.0.0.1:$PORT" --model minilm -n "$N" &
    LOAD_PID=$!
    sleep 2
    kill -9 "$victim" && echo "killed pid $victim"
    wait $LOAD_PID || FAILED=1
    for _ in $(seq 1 90); do
        [ "$(grep -c "spawned: 'worker-minilm-gpu0-0'" .run/$PORT/supervisord.log)" -ge 2 ] && \
            timeout 30 "$PY" scripts/gpu_check.py report --url "http://127.0.0.1:$PORT" --model minilm --workers 3 \
                >/dev/null 2>&1 && break
        sleep 1
    done
    check 3
fi
stop_stack
echo "== 4. calibration: the simulated prediction beside CUDA's max_memory_reserved and NVML's per-process figure"
timeout 600 "$PY" scripts/gpu_check.py calibrate --models "${CALIBRATE_MODELS:-minilm,efficientnet,smollm2}" \
    --batches "${CALIBRATE_BATCHES:-1,8,32}" || echo "calibration did not finish (not a check)"
echo "== took $(( $(date +%s) - started )) s"
if [ $FAILED = 0 ]; then echo "gpu_check: PASS"; else echo "gpu_check: FAIL"; fi
exit $FAILED
