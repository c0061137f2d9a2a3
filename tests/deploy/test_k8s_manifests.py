"""What deploy/k8s/ ships, checked without a cluster: each overlay renders with `kubectl
kustomize`, every built-in object passes the Kubernetes schema (kubernetes-validate, strict,
offline), the KEDA objects pass KEDA's CRD schema (cloudcoil's models generated from it, made
strict), and the ScaledObject names the stream and group the code uses (shared/keys.py), so
renaming a key breaks this test, not autoscaling in production."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication

from tests.ci import require_part
from tests.keda import figure_kind, stream_triggers
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.settings import Settings, check_env_names

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ["gpu", "cpu"]
KUBERNETES_VERSION = "1.30.0"
# redis-streams trigger metadata KEDA documents (keda.sh/docs/latest/scalers/redis-streams/).
KEDA_REDIS_STREAMS_KEYS = {
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "usernameFromEnv",
    "passwordFromEnv", "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "enableTLS", "unsafeSsl", "databaseIndex",
}
CRD_MODELS = {"ScaledObject": ScaledObject, "TriggerAuthentication": TriggerAuthentication}

@pytest.fixture(autouse=True)
def _kubectl() -> None:
    """kubectl renders the overlays: skipped without it here, a failure in CI (tests/ci.py)."""
    require_part(shutil.which("kubectl"), "kubectl not installed (the machine image ships it; Debian's is too old)")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def strict_schema(model: Any) -> dict[str, Any]:
    """The model's JSON schema with additionalProperties false wherever the CRD lists properties
    (pydantic's models accept unknown fields; the API server would prune them silently)."""
    schema: dict[str, Any] = model.model_json_schema(by_alias=True)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_settings(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The VRAMGUARD_* values a container gets: its ConfigMap (envFrom) plus its literal env."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        values.update(next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == name)["data"])
    values.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return {k: v for k, v in values.items() if k.startswith("VRAMGUARD_")}


def settings_of(values: dict[str, str]) -> Settings:
    """The Settings a process builds from `values` as its environment: names checked, and the
    per-model knobs (VRAMGUARD_MODELS__<MODEL>__<KNOB>) nested as env_nested_delimiter nests them."""
    check_env_names(values)
    flat: dict[str, object] = {}
    models: dict[str, dict[str, str]] = {}
    for key, value in values.items():
        name = key.removeprefix("VRAMGUARD_").lower()
        if name.startswith("models__"):
            _models, model, knob = name.split("__", 2)
            models.setdefault(model, {})[knob] = value
        else:
            flat[name] = value
    return Settings(**flat, models=models)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_passes_the_kubernetes_schema(overlay: str) -> None:
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "ConfigMap"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_MODELS:
            jsonschema.validate(doc, strict_schema(CRD_MODELS[doc["kind"]]))
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_misspelled_field_fails_both_schema_checks() -> None:
    docs = render("cpu")
    deployment = by_kind(docs, "Deployment")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    scaled = by_kind(docs, "ScaledObject")[0]
    scaled["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, strict_schema(ScaledObject))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_object_watches_the_stream_and_group_the_workers_use(overlay: str) -> None:
    docs = render(overlay)
    scaled = by_kind(docs, "ScaledObject")[0]
    target = scaled["spec"]["scaleTargetRef"]["name"]
    worker = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == target)
    container = worker["spec"]["template"]["spec"]["containers"][0]
    # The worker's own Settings, built from what the manifests give it (a bad name fails here too).
    values = env_settings(docs, container)
    settings = settings_of(values)
    stream = Keys(settings.key_prefix).request_stream(settings.model)
    # The stream's length is the backlog KEDA reads: one request per entry, so it counts requests.
    assert settings.model_config_for(settings.model).max_requests_per_entry == 1
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    for trigger in triggers:
        meta = trigger["metadata"]
        assert set(meta) <= KEDA_REDIS_STREAMS_KEYS, set(meta) - KEDA_REDIS_STREAMS_KEYS
        assert meta["stream"] == stream
        assert meta.get("consumerGroup", GROUP) == GROUP
        env_names = {e["name"] for e in container["env"]}
        assert meta["addressFromEnv"] in env_names  # KEDA reads it from the scale target's container


def test_autoscaling_reads_the_stream_length_which_no_redis_version_leaves_unknown() -> None:
    """The lag is NULL on Redis >= 7.2 while a backlog is served out of order (read as 0), pending
    entries never exceed what the workers hold: only the stream length tracks the backlog. The
    integration test test_keda_figure.py checks that figure against a real Redis and workers."""
    kinds = {figure_kind(meta) for meta in stream_triggers(by_kind(render("gpu"), "ScaledObject"))}
    assert kinds == {"length"}, kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_exceed_the_drain_and_no_password_is_in_a_manifest(overlay: str) -> None:
    docs = render(overlay)
    for deployment in by_kind(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        values = env_settings(docs, container)
        grace_s = float(values["VRAMGUARD_SHUTDOWN_GRACE_S"]) + float(values.get("VRAMGUARD_SHUTDOWN_DELAY_S", 0))
        assert pod["terminationGracePeriodSeconds"] > grace_s
        url = next(e for e in container["env"] if e["name"] == "VRAMGUARD_REDIS_URL")
        assert url["valueFrom"]["secretKeyRef"]["name"] == "vramguard-redis"
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert any(d["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
                   for d in by_kind(docs, "Deployment"))


def test_gpu_overlay_gives_each_worker_one_gpu_and_probes_its_heartbeat() -> None:
    docs = render("gpu")
    worker = next(d for d in by_kind(docs, "Deployment") if "worker" in d["metadata"]["name"])
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    values = env_settings(docs, container)
    assert values["VRAMGUARD_WORKERS_PER_GPU"] == "1" and values["VRAMGUARD_DEVICE"] == "cuda"
    assert "CUDA_VISIBLE_DEVICES" not in {e["name"] for e in container["env"]}  # the device plugin sets it
    assert container["livenessProbe"]["exec"]["command"][:3] == ["python", "-m", "vramguard.worker.health.alive"]
    assert (K8S.parents[1] / "worker" / "health" / "alive.py").exists()
    gateway = next(d for d in by_kind(docs, "Deployment") if "gateway" in d["metadata"]["name"])
    probes = gateway["spec"]["template"]["spec"]["containers"][0]
    assert (probes["readinessProbe"]["httpGet"]["path"], probes["livenessProbe"]["httpGet"]["path"]) == (
        "/health/ready", "/health/live")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_serves_through_a_rollout_and_its_settings_hold(overlay: str) -> None:
    """On SIGTERM the gateway serves on until its readiness probe has failed (periodSeconds x
    failureThreshold) with seconds to spare for the endpoint change to spread; its settings (the
    body bounds among them) are valid Settings."""
    docs = render(overlay)
    gateway = next(d for d in by_kind(docs, "Deployment") if "gateway" in d["metadata"]["name"])
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    values = env_settings(docs, container)
    probe = container["readinessProbe"]
    assert float(values["VRAMGUARD_SHUTDOWN_DELAY_S"]) >= probe["periodSeconds"] * probe["failureThreshold"] + 5
    settings = settings_of(values)
    assert settings.max_inflight_body_bytes <= 100 * 2**20  # the 1Gi arithmetic in gateway.yaml
    assert container["resources"]["limits"]["memory"] == "1Gi"


def surge_pods(deployment: dict[str, Any]) -> int:
    """Pods a rollout may run above `replicas`, as the Deployment controller computes it: Recreate
    none; RollingUpdate maxSurge, a count or a percentage rounded up, 25% when unset
    (kubernetes.io/docs/concepts/workloads/controllers/deployment/#max-surge)."""
    strategy = deployment["spec"].get("strategy", {})
    if strategy.get("type") == "Recreate":
        return 0
    surge = strategy.get("rollingUpdate", {}).get("maxSurge", "25%")
    replicas = int(deployment["spec"].get("replicas", 1))
    if isinstance(surge, str) and surge.endswith("%"):
        return -(-replicas * int(surge[:-1]) // 100)
    return int(surge)


def test_gpu_worker_rollout_needs_no_gpu_beyond_those_its_pods_hold() -> None:
    """A rollout on a cluster whose GPUs are all taken: a surge pod would wait for a GPU forever."""
    worker = next(d for d in by_kind(render("gpu"), "Deployment") if "worker" in d["metadata"]["name"])
    assert worker["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert surge_pods(worker) == 0, worker["spec"].get("strategy")
    unavailable = worker["spec"].get("strategy", {}).get("rollingUpdate", {}).get("maxUnavailable", 1)
    assert unavailable not in (0, "0%")  # with no surge, 0 unavailable would deadlock the rollout
