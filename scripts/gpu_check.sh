#!/usr/bin/env bash
# The memory budget's check on a machine with a CUDA GPU (under 8 minutes). Needs a Python with the CUDA
# torch, the project's dependencies (pip install -e ".[worker,redis]") and torchvision.
#   1. worker.profile on minilm (cuda), then ResNet-50 fp16 (random weights): the three numbers
#      (baseline, weights, per-item/per-token peak) and the derived limits;
#   2. the stack (deploy/up.py under supervisor) with one minilm worker at a deliberately small
#      memory fraction: by default the watermark that fits baseline + weights + fixed + 8 texts of
#      256 tokens (from 1a's plan), so the budget binds; 500 concurrent requests, one in 8 at the
#      model's maximum length, then: peak allocated vs budget, OOM count, requests lost (must be 0);
#   3. the stack with two minilm workers on GPU 0 (make up GPUS=0 WORKERS_PER_GPU=2): each pinned
#      by CUDA_VISIBLE_DEVICES with half the watermark; 500 concurrent requests, then: their budgets
#      add up to at most watermark x total, no OOM event, no request lost.
# Usage: scripts/gpu_check.sh   (PYTHON=..., WATERMARK=..., PORT=8765, REDIS_PORT=6391 override)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
PORT=${PORT:-8765}
REDIS_PORT=${REDIS_PORT:-6391}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

echo "== environment"
"$PY" -c "import torch, torchvision; assert torch.cuda.is_available(), 'no CUDA device'; \
p = torch.cuda.get_device_properties(0); print(torch.__version__, torchvision.__version__, p.name, p.total_memory, 'bytes')"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true

echo "== 1a. python -m vramguard.worker.profile --model minilm --device cuda"
timeout 180 "$PY" -m vramguard.worker.profile --model minilm --device cuda
PLAN=$(timeout 120 "$PY" -m vramguard.worker.profile --model minilm --device cuda --json 2>/dev/null)
WATERMARK=${WATERMARK:-$("$PY" -c 'import json, sys; p = json.loads(sys.argv[1]); print(round((p["context_bytes"]
    + p["weights_bytes"] + p["fixed_bytes"] + p["per_token_bytes"] * 8 * 256) / p["total_bytes"] * 1.02, 6))' "$PLAN")}
timeout 120 "$PY" -m vramguard.worker.profile --model minilm --device cuda --json --total-bytes $((16 * 1024 ** 3)) \
    --workers-per-gpu 2 2>/dev/null | sed 's/^/planned for a 16 GiB GPU shared by 2 workers: /'

echo "== 1b. ResNet-50 fp16 (torchvision, random weights)"
timeout 180 "$PY" scripts/gpu_check.py resnet

# run_stack LABEL ENV... -- UP_ARGS...: start deploy/up.py with ENV, wait for readiness, leave it
# running (UP_PID); its logs are in .run/$PORT/.
run_stack() {
    local label=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    echo "== $label"
    RUN_LOG=$(mktemp)
    env VRAMGUARD_PORT=$PORT VRAMGUARD_REDIS_PORT=$REDIS_PORT VRAMGUARD_DEVICE=cuda \
        VRAMGUARD_MODELS__MINILM__MAX_WAIT_MS=10 "${envs[@]}" "$PY" deploy/up.py --run-dir .run/$PORT "$@" >"$RUN_LOG" 2>&1 &
    UP_PID=$!
    for _ in $(seq 1 180); do
        grep -q "vramguard is ready" "$RUN_LOG" && break
        kill -0 $UP_PID 2>/dev/null || { cat "$RUN_LOG"; tail -n 30 .run/$PORT/worker-*.log; exit 1; }
        sleep 1
    done
    grep -q "vramguard is ready" "$RUN_LOG" || { echo "stack not ready"; tail -n 30 .run/$PORT/worker-*.log; exit 1; }
    grep "^up: worker-" "$RUN_LOG" || true
    grep -h '"memory plan"' .run/$PORT/worker-*.log | tail -n 2 || true
}
stop_stack() { kill -TERM $UP_PID 2>/dev/null || true; wait $UP_PID 2>/dev/null || true; }
trap stop_stack EXIT

run_stack "2. stack: 1 minilm worker at watermark $WATERMARK, 500 concurrent requests" \
    VRAMGUARD_WATERMARK=$WATERMARK -- --model minilm --gpus 0 --workers-per-gpu 1
timeout 240 "$PY" scripts/gpu_check.py load --url "http://127.0.0.1:$PORT" --model minilm -n 500
nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
stop_stack

run_stack "3. stack: 2 minilm workers on GPU 0 (WORKERS_PER_GPU=2), 500 concurrent requests" \
    VRAMGUARD_WATERMARK=0.8 -- --model minilm --gpus 0 --workers-per-gpu 2
timeout 240 "$PY" scripts/gpu_check.py load --url "http://127.0.0.1:$PORT" --model minilm -n 500
"$PY" scripts/gpu_check.py shares --url "http://127.0.0.1:$PORT" --model minilm --workers 2
nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
stop_stack
