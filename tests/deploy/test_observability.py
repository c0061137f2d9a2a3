"""deploy/observability/ checked with real tools: Prometheus' promtool validates and unit-tests the
alert rules, and a real Prometheus scrapes a real stack (gateway and a worker on a simulated GPU,
so the memory series exist) and evaluates every query of the Grafana dashboard: each must find
series, and every series an alert rule names must be one the stack exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.ci import require_part
from tests.helpers import Stack, free_port, wait_until

OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
MIB = 1024 * 1024
# Grafana's variables as a dashboard at "All models" over the last minute would expand them
# (https://grafana.com/docs/grafana/latest/dashboards/variables/add-template-variables/#global-variables).
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$__range": "1m", "$model": ".*"}
METRIC_NAME = re.compile(r"\bvramguard_[a-z_]+\b")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    require_part(binary, "promtool (Debian package prometheus; .ci/run installs it)")
    assert binary is not None
    return subprocess.run([binary, *args], cwd=OBSERVABILITY, capture_output=True, text=True, timeout=60, check=False)


def test_the_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_alert_fires_on_its_problem_and_not_on_a_healthy_stack() -> None:
    """alerts.test.yml: input series for a healthy stack (no alert) and for each problem (its alert,
    labels and rendered annotations)."""
    done = promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables expanded) for every target of the dashboard."""
    dashboard = json.loads((OBSERVABILITY / "vramguard-dashboard.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append((panel["title"], expr))
    return out


def alert_metric_names() -> set[str]:
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())
    return {name for group in rules["groups"] for rule in group["rules"] for name in METRIC_NAME.findall(rule["expr"])}


@pytest.fixture
def prometheus(stack: Stack, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping `stack`'s gateway every second; yields its URL."""
    binary = shutil.which("prometheus")
    require_part(binary, "prometheus (Debian package prometheus; .ci/run installs it)")
    assert binary is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n"
                      f"  - job_name: vramguard\n    static_configs: [{{targets: ['127.0.0.1:{stack.port}']}}]\n")
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
async def test_every_dashboard_query_finds_series_on_a_real_stack(stack: Stack, prometheus: str,
                                                                   redis_client: aioredis.Redis) -> None:
    """1. A gateway and a synthetic worker on a 256 MiB simulated GPU serve a few requests; Redis
       has a maxmemory (so the used/maxmemory query has a denominator).
    2. A real Prometheus scrapes the gateway every second.
    Result: every dashboard query evaluates (valid PromQL) to at least one series, and every
    series an alert rule names is in the gateway's /metrics."""
    await redis_client.config_set("maxmemory", str(512 * MIB))
    try:
        stack.start_gateway(served_models="synthetic")
        stack.start_worker(model="synthetic", device="sim", sim_memory_bytes=256 * MIB)
        await stack.wait_ready()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            for i in range(5):
                assert (await client.post("/v1/models/synthetic/infer", json={"inputs": [i, i]})).status_code == 200
            scraped = (await client.get("/metrics")).text
        exported = {s.name for family in text_string_to_metric_families(scraped) for s in family.samples}
        assert alert_metric_names() - exported == set()
        async with httpx.AsyncClient(base_url=prometheus, timeout=10) as prom:
            empty: list[str] = []

            async def all_found() -> bool:
                empty.clear()
                for title, expr in dashboard_queries():
                    try:
                        reply = (await prom.get("/api/v1/query", params={"query": expr})).json()
                    except httpx.TransportError:  # Prometheus still starting
                        empty.append("(Prometheus not answering yet)")
                        return False
                    assert reply["status"] == "success", (title, expr, reply)
                    if not reply["data"]["result"]:
                        empty.append(f"{title}: {expr}")
                return not empty

            try:
                await wait_until(all_found, 60, interval_s=1)
            except AssertionError:
                raise AssertionError("dashboard queries without series:\n" + "\n".join(empty)) from None
    finally:
        await redis_client.config_set("maxmemory", "0")
