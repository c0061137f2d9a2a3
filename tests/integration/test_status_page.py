"""The status page in a real headless Chromium against a real gateway process: after its script
ran, the DOM shows the numbers of /status.json, and a screenshot is kept in test-artifacts/."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from tests.ci import require_part
from tests.helpers import ROOT, Stack, wait_until
from tests.integration.test_metrics import MEMORY_FIELDS, beat_like_a_worker
from vramguard.shared.keys import Keys

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def run_chromium(url: str, profile: Path, *args: str) -> str:
    """Load `url` in headless Chromium, let its script run for 4 s of virtual time; stdout."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=4000", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=45, check=False)  # noqa: S603
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def texts_by_testid(dom: str) -> dict[str, str]:
    """Text of each leaf element with a data-testid in a dumped DOM."""
    return {m.group(1): m.group(2).strip() for m in re.finditer(r'data-testid="([^"]+)"[^>]*>([^<]*)<', dom)}


SIM_STATS = {"items_per_s": "12.5", "last_batch_size": "8", "mean_batch_size_1m": "7.5", "max_batch_size": "64",
             "batches": "40", "items": "300", "errors": "0", "probes": "3", "probe_failures": "0",
             "gpu_utilization_percent": "63", "started_ms": str(int(time.time() * 1000) - 95_000)}


async def keep_beating(redis: aioredis.Redis, keys: Keys) -> None:
    """A simulated-device worker pinned to simulated GPU 1 that reports memory, beating every 200 ms."""
    while True:
        await beat_like_a_worker(redis, keys, "sim-gpu-0", {**MEMORY_FIELDS, **SIM_STATS}, ttl_ms=1500)
        await asyncio.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(240)  # the phases' own bounds (60 + 30 + 2 x 45 s) fail first, saying which
async def test_status_page_renders_its_numbers_in_chromium(stack: Stack, redis_client, tmp_path: Path) -> None:
    """1. A gateway and a synthetic worker run as processes; 12 requests are served; a simulated
       GPU worker reports memory and its placement through its heartbeat.
    2. Headless Chromium loads `/` and runs the page's script.
    Result: the DOM shows readiness, queue numbers, worker states, throughput, the memory
    numbers and one card per GPU summing its workers; the screenshot is kept in
    test-artifacts/status-page.png."""
    require_part(CHROMIUM, "no chromium binary (apt-get install -y chromium; .ci/run does)")
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic")
    await stack.wait_ready(60)
    beating = asyncio.create_task(keep_beating(redis_client, Keys(str(stack.settings["key_prefix"]))))
    try:
        # Each phase has a bound of its own, so that a stall says where it was, with the stack's logs.
        try:
            async with asyncio.timeout(30), httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
                for i in range(12):
                    assert (await client.post("/v1/models/synthetic/infer", json={"inputs": [i]})).status_code == 200

                async def both_live() -> bool:
                    models = (await client.get("/status.json")).json()["models"]
                    return models[0]["live_workers"] == 2 and models[0]["workers"][1].get("items", 0) == 12

                await wait_until(both_live, 10)
        except (TimeoutError, httpx.HTTPError) as exc:
            raise AssertionError(f"12 requests and /status.json within 30 s: {exc!r}; logs:\n{stack.logs()}") from exc
        dom = await asyncio.to_thread(run_chromium, stack.url + "/", tmp_path / "profile", "--dump-dom")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "status-page.png"
        shot.unlink(missing_ok=True)
        await asyncio.to_thread(run_chromium, stack.url + "/status", tmp_path / "profile2",
                                f"--screenshot={shot}", "--window-size=1500,700")
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating

    found = texts_by_testid(dom)
    assert found["live-synthetic"] == "2" and found["queue-synthetic"] == "0"
    assert found["pending-synthetic"] == "0" and found["dlq-synthetic"] == "0"
    assert found["state-test-worker-0"] == found["state-sim-gpu-0"] == "ready"
    assert float(found["ips-test-worker-0"]) > 0
    assert found["mem-allocated-sim-gpu-0"] == "1.00 GiB" and found["mem-reserved-sim-gpu-0"] == "2.00 GiB"
    assert found["mem-peak-sim-gpu-0"] == "1.50 GiB"
    assert found["mem-budget-sim-gpu-0"] == "6.00 GiB" and found["mem-total-sim-gpu-0"] == "8.00 GiB"
    # The GPU card of the simulated worker's GPU sums its workers (one here) and shows its share.
    assert found["gpu-workers-1"] == "1" and found["gpu-share-1"] == "0.40"
    assert found["gpu-allocated-1"] == "1.00 GiB" and found["gpu-budget-1"] == "6.00 GiB"
    assert found["gpu-total-1"] == "8.00 GiB" and found["gpu-of-sim-gpu-0"] == "sim · GPU 1"
    assert found["gpu-workers-cpu"] == "1"  # the real CPU worker, unpinned
    assert 'id="ready" class="badge ok">ready<' in dom
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000, len(png)
