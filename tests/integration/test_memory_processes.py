"""The memory budget with real processes: `python -m vramguard.gateway` and `python -m vramguard.worker` on the
simulated device, and a real supervisord restarting a worker whose CUDA context broke."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import RedisServer, Stack, SupervisedWorker, service_env, wait_until

MIB = 1024 * 1024
HEARTBEAT_MEMORY_FIELDS = (
    "device_kind", "mem_total_bytes", "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes",
    "mem_budget_bytes", "oom_events", "batch_splits", "adaptive_batch_cap", "plan_context_bytes", "plan_weights_bytes",
    "plan_fixed_bytes", "plan_per_item_bytes", "plan_per_token_bytes", "plan_batch_size", "plan_batch_tokens",
    "memory_share",
)


async def only_worker(client: httpx.AsyncClient) -> dict[str, object]:
    workers = (await client.get("/v1/models/synthetic")).json()["workers"]
    assert len(workers) == 1, workers
    return next(iter(workers.values()))  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_200_concurrent_requests_on_a_small_simulated_device(stack: Stack) -> None:
    """1. One worker process on a 256 MiB simulated device: the plan allows 6 items per forward
    (0.8 x 256 = 204.8 MiB; (204.8 - 12 outside the allocator - 128 weights - 16 fixed) / 8 per
    item = 6.1), cap 64.
    2. 200 concurrent requests.
    Result: all 200 succeed, no OOM was raised, no forward ran more than 6 items, the peak stayed
    in the budget, and GET /v1/models/synthetic shows the measured plan in the heartbeat."""
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", device="sim", sim_memory_bytes=256 * MIB,
                       models__synthetic__max_wait_ms=20, models__synthetic__params='{"batch_ms": 10, "item_ms": 1}')
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/models/synthetic/infer", json={"inputs": [i]}) for i in range(200))
        )
        assert [r.status_code for r in responses] == [200] * 200, {r.text for r in responses if r.status_code != 200}
        assert [r.json()["outputs"] for r in responses] == [[i] for i in range(200)]

        async def counted() -> bool:
            return (await only_worker(client))["requests"] >= 200  # type: ignore[operator]

        await wait_until(counted, 10)
        beat = await only_worker(client)
    assert all(beat.get(name) is not None for name in HEARTBEAT_MEMORY_FIELDS), beat
    assert beat["device_kind"] == "sim" and beat["mem_total_bytes"] == 256 * MIB
    assert beat["plan_batch_size"] == 6 and beat["plan_weights_bytes"] == 128 * MIB
    assert beat["plan_fixed_bytes"] == 16 * MIB and beat["plan_per_item_bytes"] == 8 * MIB
    assert beat["oom_events"] == 0 and beat["adaptive_batch_cap"] == 6 and beat["memory_share"] == 0.8
    assert 1 < beat["largest_forward"] <= 6 and beat["max_batch_seen"] <= 6  # type: ignore[operator]
    assert beat["mem_peak_bytes"] <= beat["mem_budget_bytes"]  # type: ignore[operator]
    assert beat["plan_context_bytes"] == beat["mem_outside_bytes"] == 12 * MIB
    assert beat["mem_cap_bytes"] == int(0.8 * 256 * MIB) - 12 * MIB
    assert beat["mem_max_reserved_bytes"] <= beat["mem_cap_bytes"]  # type: ignore[operator]


@pytest.fixture
def supervised_worker(redis_server: RedisServer, key_prefix: str, tmp_path: Path) -> Iterator[Path]:
    """A real supervisord (the shipped config, run dir tmp_path) running one synthetic worker on the
    simulated device, with the one-shot CUDA error hook at tmp_path/cuda-error. Yields tmp_path."""
    env = service_env(
        redis_server.url, key_prefix=key_prefix, model="synthetic", device="sim",
        block_ms=200, heartbeat_interval_ms=200, heartbeat_ttl_ms=1500, fault_cuda_error_file=tmp_path / "cuda-error",
        models__synthetic__max_wait_ms=200, models__synthetic__params='{"batch_ms": 20}',
    )
    supervised = SupervisedWorker(tmp_path, env)
    supervised.start()
    yield tmp_path
    supervised.stop()


def logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(folder.glob("*.log")))


@pytest.mark.slow
async def test_cuda_error_restarts_the_worker_and_its_batch_is_answered(gateway, supervised_worker: Path) -> None:
    """1. A worker under a real supervisord serves a batch of 8 requests.
    2. Its forward hits a (non-OOM) CUDA error: the context is not trusted.
    Result: the process exits with code 5 (CUDA_CONTEXT_LOST) without acking, supervisord starts
    a new one under the same consumer name, it replays the pending batch, all 8 requests are
    answered, and the old process is gone (nothing of it holds device memory)."""
    folder = supervised_worker

    async def live_pid() -> int | None:
        workers = (await gateway.get("/v1/models/synthetic")).json()["workers"]
        return int(next(iter(workers.values()))["pid"]) if workers else None

    try:
        await wait_until(lambda: live_pid(), 90, interval_s=0.2)
    except AssertionError:
        raise AssertionError(f"supervised worker never became live:\n{logs(folder)}") from None
    first_pid = await live_pid()
    assert (await gateway.post("/v1/models/synthetic/infer", json={"inputs": [0, 0]})).status_code == 200
    (folder / "cuda-error").touch()
    responses = await asyncio.gather(*(
        gateway.post("/v1/models/synthetic/infer", json={"inputs": [i], "timeout_ms": 90_000}) for i in range(8)
    ))
    assert [r.status_code for r in responses] == [200] * 8, logs(folder)
    assert [r.json()["outputs"] for r in responses] == [[i] for i in range(8)]
    assert not (folder / "cuda-error").exists()  # the hook fired

    async def restarted() -> bool:
        pid = await live_pid()
        return pid is not None and pid != first_pid

    await wait_until(restarted, 10)
    supervisor_log = (folder / "supervisord.log").read_text()
    assert "exit status 5" in supervisor_log, supervisor_log
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)  # type: ignore[arg-type]
