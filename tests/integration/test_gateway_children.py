"""A gateway killed outright (SIGKILL, as the OOM killer or `docker kill` does) leaves no process
of its own behind: its JSON counting helper (gateway/edge/bodycost.py) and multiprocessing's resource
tracker end with it instead of living on, orphaned."""

from __future__ import annotations

import signal

import httpx
import psutil

from tests.helpers import Stack, wait_until


async def test_a_sigkilled_gateway_leaves_no_child_process(stack: Stack) -> None:
    """1. A gateway process, given a body large enough to be counted by its helper process.
    2. The gateway is SIGKILLed.
    Result: every child it had (the helper, the resource tracker) is gone within 15 s."""
    stack.start_gateway()
    assert stack.gateway is not None

    def live() -> bool:
        try:
            return httpx.get(stack.url + "/health/live", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    await wait_until(live, 60)
    body = b"[" + b"1," * 40_000 + b"1]"  # past the inline limit: counted in the helper
    httpx.post(stack.url + "/v1/models/synthetic/infer", content=body,
               headers={"Content-Type": "application/json"}, timeout=30)
    children = psutil.Process(stack.gateway.pid).children(recursive=True)
    assert children, "the gateway started no helper process"
    stack.gateway.send_signal(signal.SIGKILL)
    stack.gateway.wait(10)
    await wait_until(lambda: not any(_alive(child) for child in children), 15, interval_s=0.1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
