"""The one settings object of a process, read from VRAMGUARD_* environment variables.

Build it once in `__main__` with `Settings.from_env()` and pass it down; no other module
reads the environment. A misspelled or out-of-range variable stops the process with a
message naming it.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
from collections.abc import Mapping
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import AliasChoices, Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from vramguard.shared.eventloop import EventLoopChoice
from vramguard.shared.models import BUILTIN, ModelConfig, ModelOverrides, ModelSpec, load_models_file

ENV_PREFIX = "VRAMGUARD_"
REDIS_SCHEMES = ("redis", "rediss", "unix")  # what redis-py's from_url accepts
# Where a user finds every setting's name; an unknown-setting error points here instead of listing them.
SETTINGS_LIST = "docs/reference/settings.md, or python -m vramguard.gateway --help"


class SettingsError(ValueError):
    """A VRAMGUARD_* variable is unknown or invalid; the message names it."""


class Settings(BaseSettings):
    """Settings of a gateway or worker process. Durations end in _ms or _s, sizes in _bytes.

    shutdown_grace_s must stay below supervisor's `stopwaitsecs` (deploy/supervisord.conf) and
    Kubernetes' terminationGracePeriodSeconds, or the worker is killed mid-drain.
    """

    # No setting takes inf or nan: JSON (logs, /v1/models) cannot carry them, and none means "forever".
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True, allow_inf_nan=False
    )

    # --- where things are ---
    redis_url: str = "redis://127.0.0.1:6379/0"  # the broker; its password is masked in logs
    # First segment of every Redis key (<prefix>:req:{<model>}, ...; shared/keys.py).
    key_prefix: str = Field("vramguard", pattern=r"^[A-Za-z0-9_.-]+$")
    host: str = "0.0.0.0"  # gateway: the address it binds
    port: int = Field(8000, ge=1, le=65535)  # gateway: the port it listens on
    # --- Redis topology (shared/redis_client.py): a plain URL, Sentinel, or Cluster ---
    # Sentinel: host:port of each sentinel, comma-separated; the primary named redis_sentinel_master is
    # looked up through them (redis_url then only gives the password and db number).
    redis_sentinels: Annotated[list[str], NoDecode] = []
    redis_sentinel_master: str = "vramguard"  # the name the sentinels monitor the primary under
    redis_sentinel_password: SecretStr | None = None  # when the sentinels themselves require AUTH
    # Cluster: redis_url names any one node; the client discovers the rest and follows MOVED.
    redis_cluster: bool = False
    # Start-up check of maxmemory-policy: "warn" logs loudly when Redis may evict our keys, "refuse" exits.
    redis_eviction_check: Literal["warn", "refuse", "off"] = "warn"
    # redis-py's reply parser: hiredis (C) when installed ("auto"), or redis-py's pure-Python one
    # ("python": the before-figure of the serving-cost benchmark, or to rule hiredis out).
    redis_parser: Literal["auto", "python"] = "auto"

    # --- what is served ---
    served_models: Annotated[list[str], NoDecode] = ["minilm"]  # gateway: comma-separated names
    model: str = "minilm"  # worker: the one model this process serves
    models: dict[str, ModelOverrides] = Field(default_factory=dict)
    # A TOML file of the user's own models (shared/models.py `load_models_file`); gateway and
    # workers read the same file, so the gateway knows each model's description without its code.
    models_file: str | None = None
    # Worker: "auto" (CUDA if torch sees a GPU), "cpu", "cuda", or "sim" (simulated GPU memory,
    # worker/memory/simdevice.py: tests and demos).
    device: Literal["auto", "cpu", "cuda", "sim"] = "auto"
    torch_threads: int = Field(0, ge=0)  # 0 = torch's default
    worker_name: str | None = None  # consumer name; stable across restarts when set (supervisor sets it)

    # --- timing ---
    block_ms: int = Field(1000, ge=10, le=60_000)  # XREADGROUP / XREAD BLOCK while idle
    heartbeat_interval_ms: int = Field(1000, ge=50)  # how often a worker beats (below heartbeat_ttl_ms)
    heartbeat_ttl_ms: int = Field(5000, ge=100)  # a worker is live while its heartbeat is younger
    # Gateway: a model whose workers were live within this many seconds keeps accepting requests while
    # none is live (they are restarting); past it, or never seen, 503 at once. 0: 503 as soon as none is live.
    worker_return_grace_s: float = Field(30.0, ge=0, le=3600)
    reply_stream_ttl_s: int = Field(60, ge=5)  # a dead gateway's reply stream expires after this
    # Approximate cap on a gateway's reply stream: replies are read within milliseconds, so it only
    # bounds a stalled gateway's stream.
    reply_stream_maxlen: int = Field(10_000, ge=100)
    shutdown_grace_s: float = Field(10.0, gt=0)  # drain time on SIGTERM (supervisor's stopwaitsecs is 20)
    # Gateway: after SIGTERM it keeps serving this long, readiness failing, before its drain: a
    # load balancer (a Kubernetes Service) keeps sending it new connections until it has seen the
    # readiness fail or the endpoint removal; 0 (supervisor, compose): drain at once.
    shutdown_delay_s: float = Field(0.0, ge=0, le=600)

    # --- HTTP ---
    # Gateway: a larger request body, before or after gzip/deflate decompression, gets 413.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # JSON values (scalars, lists, objects) one request body may hold: parsing builds one Python object
    # each on the event loop (gateway/edge/bodycost.py). 65,536 holds 256 inputs of 254 token ids (OpenAI).
    max_json_values: int = Field(65_536, ge=1024)
    # Request body bytes one gateway process holds at once (gateway/edge/bodybudget.py), at least one
    # body at the cap. 96 MiB: a request holds about 4.6 x its body in memory (body, parsed inputs,
    # packed request: measured), so 442 MiB, plus the process (82 MiB) and its JSON counting
    # process (260 MiB at most) fit the Kubernetes gateway's 1 GiB limit (docs/guides/kubernetes.md).
    max_inflight_body_bytes: int = Field(96 * 1024 * 1024, ge=1024)
    access_log: bool = False  # uvicorn's access log (JSON logs on stderr either way)
    # The event loop of the gateway (uvicorn's `loop`) and of the worker (shared/eventloop.py):
    # uvloop when installed ("auto"), or asyncio's own.
    event_loop: EventLoopChoice = "auto"
    # Several gateway processes on one port (`make up GATEWAYS=N`): each binds with SO_REUSEPORT and
    # the kernel spreads connections over them; each keeps its own reply stream.
    reuse_port: bool = False
    # Gateway processes of one host that share their metrics (`make up` gateways): prometheus_client's
    # multiprocess mode. Each process keeps its series in mmap files in this directory and `/metrics`,
    # from any of them, renders the sum (gateway/observe/metrics.py). The library reads
    # PROMETHEUS_MULTIPROC_DIR itself when it is imported, before any Settings exist, so that
    # variable (not a VRAMGUARD_ one) is this setting: one name, read by both, cannot disagree.
    # deploy/supervisord.conf sets it for the gateway program only. Unset: the process's own registry.
    prometheus_multiproc_dir: str | None = Field(
        None, validation_alias=AliasChoices("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
    )
    # Gateway: when set, /v1/... and /v2/... (but /v2/health/*) require it (Authorization: Bearer, or
    # X-API-Key); masked in logs; an empty or whitespace key stops the gateway (exit 2).
    api_key: SecretStr | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # of the JSON log lines on stderr
    # The HTTP server's limits against slow or hostile clients (gateway/edge/server.py). Keep-alive:
    # longer than the idle timeout of the pools and load balancers in front (ALB 60 s, nginx 60 s,
    # aiohttp 15 s, httpx 5 s), so the client side always closes an idle connection first and never
    # sends a request on one the gateway is closing.
    http_keep_alive_s: int = Field(75, ge=1, le=3600)
    http_header_timeout_s: float = Field(10.0, gt=0, le=600)  # connection start (or first byte) to end of headers
    http_body_timeout_s: float = Field(60.0, gt=0, le=3600)  # end of headers to end of body
    http_max_connections: int = Field(1000, ge=1)  # open connections; past it a new one is closed at once
    http_max_headers: int = Field(100, ge=1, le=10_000)  # header lines per request; past it 431
    http_max_header_bytes: int = Field(16_384, ge=1024, le=1_048_576)  # request line + headers; past it 431

    # --- testing ---
    fault_injection: bool = False  # lets `synthetic` honour {"fault": ...} inputs (tests and demos only)

    # --- observability ---
    # Worker watchdog: a probe forward on the backend's example inputs after this much idle time.
    probe_interval_s: float = Field(default=30.0, gt=0, le=3600)
    # Consecutive batches in which every item failed with model_error before the worker exits unhealthy.
    max_consecutive_failed_batches: int = Field(default=5, ge=1)
    # Tests and demos only (needs fault_injection): the probe sends {"fault": probe_fault} instead.
    probe_fault: Literal["none", "raise", "cuda_error"] = "none"

    # --- memory budget and placement ---
    # The worker plans its batches from measured memory (worker/memory/budget.py): its budget is its
    # share of the device, memory_share x total device memory, and
    # torch.cuda.set_per_process_memory_fraction caps its allocator, before the first byte, at that
    # share less its own memory outside the allocator (CUDA context, kernel modules). The shares
    # of the workers on one device add up to at most the watermark (worker/memory/ledger.py checks it
    # on each host; vramguard/cli/placement.py before anything starts).
    watermark: float = Field(0.8, gt=0, le=1)  # fraction of the device's memory the workers on it may use
    workers_per_gpu: int = Field(1, ge=1, le=64)  # worker processes sharing one device (all models)
    # This worker's fraction of the device's total memory; unset: watermark / workers_per_gpu.
    memory_share: float | None = Field(None, gt=0, le=1)
    # The one GPU this worker uses (an index or a GPU UUID), as the CUDA runtime reads it. On
    # device=sim it names the simulated GPU: processes with the same value share one device.
    cuda_visible_devices: str | None = Field(
        None, validation_alias=AliasChoices("CUDA_VISIBLE_DEVICES", "cuda_visible_devices")
    )
    sim_gpus: int = Field(0, ge=0, le=64)  # `make up`: simulated GPUs the host has (0: look for real ones)
    # Where workers on this host keep their per-device ledgers (registered shares; the simulated
    # devices' memory). Unset: <tmp>/vramguard-devices. Processes that share a GPU must share it
    # (containers: one volume / hostPath per host, docs/concepts/memory.md).
    device_ledger_dir: str | None = None
    # At start a worker checks that its GPU has its budget free (mem_get_info): "refuse" exits (code 3)
    # naming the GPU, what is free, what it needs and who holds the rest; "warn" (a GPU shared with
    # tenants the operator knows about) logs that loudly and plans on what is free.
    memory_check: Literal["refuse", "warn"] = "refuse"
    memory_planner: bool = True  # False: no measurement, no soft guard; trust max_batch_size (tests of the OOM path)
    adaptive_success_run: int = Field(16, ge=1)  # OOM-free batches before the adaptive cap grows by one item
    sim_memory_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)  # size of the simulated device (device=sim)
    # The simulated device's memory outside the allocator per process (worker/memory/simdevice.py): the CUDA
    # context from the start, kernel modules from the first forward (lazy loading).
    sim_context_bytes: int = Field(8 * 1024 * 1024, ge=0)  # the CUDA context's
    sim_module_bytes: int = Field(4 * 1024 * 1024, ge=0)  # the kernel modules', from the first forward
    fault_cuda_error_file: str | None = None  # test hook: if this file exists, the next forward deletes it and
    #                                           raises a CUDA error (one-shot, survives the restart it causes)

    # --- delivery guarantees ---
    # A pending entry idle longer than claim_idle_ms belongs to a dead worker and is reclaimed
    # (XAUTOCLAIM). Live workers refresh the idle time of the entries they hold every
    # reclaim_interval_ms, so claim_idle_ms only has to cover a few missed refreshes, not a batch.
    claim_idle_ms: int = Field(10_000, ge=100)
    reclaim_interval_ms: int = Field(1000, ge=10)  # how often a worker refreshes its entries and looks for stale ones
    # Deliveries (Redis' delivery_count) an entry may have; the next one sends it to the dead letter.
    max_deliveries: int = Field(3, ge=1)
    # A consumer idle this long with no pending entries is a dead worker's; XGROUP DELCONSUMER removes it.
    consumer_idle_ms: int = Field(600_000, ge=1000)

    _catalogue: dict[str, ModelSpec] = PrivateAttr(default_factory=lambda: dict(BUILTIN))

    @field_validator("served_models", "redis_sentinels", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("models_file")
    @classmethod
    def _models_file_valid(cls, value: str | None) -> str | None:
        # Read here too, so that an error in the file is reported under this variable's name.
        if value is not None:
            load_models_file(value)
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        # redis-py's from_url takes these three schemes only and raises deep inside a child
        # process otherwise; "localhost:6379" would even parse as scheme "localhost".
        scheme = urlsplit(value).scheme
        if scheme not in REDIS_SCHEMES:
            raise ValueError(f"{value!r} needs a scheme: {', '.join(s + '://' for s in REDIS_SCHEMES)} "
                             "(redis://localhost:6379/0)")
        return value

    @model_validator(mode="after")
    def _check_redis(self) -> Settings:
        if self.redis_sentinels and self.redis_cluster:
            raise ValueError("redis_sentinels and redis_cluster exclude each other (Cluster fails over by itself)")
        for address in self.redis_sentinels:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"redis_sentinels: {address!r} is not host:port")
        return self

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.models_file is not None:
            self._catalogue = {**BUILTIN, **load_models_file(self.models_file)}
        for name in {*self.served_models, self.model, *self.models}:
            if name not in self._catalogue:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(self._catalogue))}")
        if not self.served_models:
            raise ValueError("served_models is empty")
        if self.heartbeat_ttl_ms <= self.heartbeat_interval_ms:
            raise ValueError("heartbeat_ttl_ms must exceed heartbeat_interval_ms")
        if self.memory_share is not None and self.memory_share > self.watermark:
            raise ValueError(f"memory_share ({self.memory_share}) must not exceed the watermark ({self.watermark})")
        if self.probe_fault != "none" and not self.fault_injection:
            raise ValueError("probe_fault needs fault_injection=true (tests and demos only)")
        for name in self.models:
            try:
                self.model_config_for(name)
            except ValidationError as exc:
                detail = "; ".join(
                    f"{ENV_PREFIX}MODELS__{name.upper()}__{'__'.join(map(str, e['loc'])).upper()}: {e['msg']}"
                    if e["loc"] else f"{ENV_PREFIX}MODELS__{name.upper()}: {e['msg']}"
                    for e in exc.errors()
                )
                raise ValueError(detail) from None
        return self

    @model_validator(mode="after")
    def _check_body_bounds(self) -> Settings:
        # One body at the cap must always fit, in the gateway and in a model's queue.
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes})")
        for name in self.served_models:
            if self.model_config_for(name).queue_bound_bytes < self.max_body_bytes:
                raise ValueError(f"{ENV_PREFIX}MODELS__{name.upper()}__QUEUE_BOUND_BYTES must be at least "
                                 f"max_body_bytes ({self.max_body_bytes})")
        return self

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty key would turn authentication on with a key an empty header matches.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is empty or whitespace; unset VRAMGUARD_API_KEY to serve without a key")
        return value

    @model_validator(mode="after")
    def _check_delivery(self) -> Settings:
        # A live worker refreshes its entries every reclaim_interval_ms and beats every
        # heartbeat_interval_ms; claim_idle_ms must survive a few missed rounds of both, and the
        # batch window, during which read entries are not yet refreshed.
        window_ms = max((self.model_config_for(m).max_wait_ms for m in {self.model, *self.models}), default=0.0)
        floor_ms = 3 * max(self.reclaim_interval_ms, self.heartbeat_interval_ms) + window_ms
        if self.claim_idle_ms < floor_ms:
            raise ValueError(
                f"claim_idle_ms ({self.claim_idle_ms}) must be at least 3 x max(reclaim_interval_ms, "
                f"heartbeat_interval_ms) + max_wait_ms = {floor_ms:g}"
            )
        if self.consumer_idle_ms <= self.claim_idle_ms + self.block_ms:
            raise ValueError("consumer_idle_ms must exceed claim_idle_ms + block_ms")
        return self

    def model_config_for(self, name: str) -> ModelConfig:
        """The catalogue defaults of `name` with this process's overrides applied.

        Raises KeyError for a name outside the catalogue, ValueError for an invalid mix.
        """
        base = self._catalogue[name].defaults
        override = self.models.get(name)
        if override is None:
            return base
        changes = override.model_dump(exclude_none=True)
        if "params" in changes:
            changes["params"] = {**base.params, **changes["params"]}
        return ModelConfig.model_validate({**base.model_dump(), **changes})

    @property
    def catalogue(self) -> dict[str, ModelSpec]:
        """Every model this process knows: the built-in ones and those of `models_file`."""
        return self._catalogue

    def spec_for(self, name: str) -> ModelSpec:
        """The catalogue entry of `name`. Raises KeyError for an unknown name."""
        # Read from the private attributes' dict itself: `self._catalogue` goes through pydantic's
        # __getattr__ fallback, ~2 µs, and the gateway looks a spec up several times per request.
        catalogue: dict[str, ModelSpec] = self.__pydantic_private__["_catalogue"]  # type: ignore[index]
        return catalogue[name]

    @property
    def effective_memory_share(self) -> float:
        """This worker's fraction of its device's total memory: `memory_share`, else the
        watermark split evenly over `workers_per_gpu`."""
        return self.memory_share if self.memory_share is not None else self.watermark / self.workers_per_gpu

    @property
    def consumer_name(self) -> str:
        """The worker's consumer name in the group: `worker_name`, else host-pid."""
        return self.worker_name or f"{socket.gethostname()}-{os.getpid()}"

    def masked(self) -> dict[str, object]:
        """The effective settings for a startup log line; secrets masked (the API key and the
        password in `redis_url`)."""
        data = self.model_dump(mode="json")
        if self.api_key is not None:
            data["api_key"] = "***"
        if self.redis_sentinel_password is not None:
            data["redis_sentinel_password"] = "***"
        data["redis_url"] = mask_url_password(self.redis_url)
        return data

    @classmethod
    def from_env(cls) -> Settings:
        """Read the process environment, refusing unknown VRAMGUARD_* names.

        Raises SettingsError naming the bad variable and why.
        """
        check_env_names(os.environ)
        try:
            return cls()
        except ValueError as exc:
            raise SettingsError(_describe(exc)) from exc


def settings_help() -> str:
    """Every setting as its environment variable and default, one per line, for a `--help`; the
    per-model knobs as VRAMGUARD_MODELS__<MODEL>__<KNOB> with the default of a model that sets none."""
    lines = ["settings (environment variables; defaults in brackets, docs/reference/settings.md explains each):"]
    for name, field in Settings.model_fields.items():
        if name == "models":
            continue  # listed knob by knob below
        alias = field.validation_alias
        env = alias.choices[0] if isinstance(alias, AliasChoices) else f"{ENV_PREFIX}{name.upper()}"
        default = "" if field.is_required() else field.get_default(call_default_factory=True)
        lines.append(f"  {env:<48} [{_shown(default)}]")
    lines.append("per-model knobs (<MODEL>: a served model's name; built-in models set some of their own defaults):")
    defaults = ModelConfig()
    for name in ModelOverrides.model_fields:
        lines.append(f"  {ENV_PREFIX}MODELS__<MODEL>__{name.upper():<30} [{_shown(getattr(defaults, name))}]")
    return "\n".join(lines)


def _shown(default: object) -> str:
    """A default as it would be written in the environment: lists comma-separated, unset for None."""
    if default is None:
        return "unset"
    if isinstance(default, list | tuple):
        return ",".join(str(v) for v in default) or "empty"
    if isinstance(default, dict):
        return json.dumps(default) if default else "{}"
    return str(default)


def mask_url_password(url: str) -> str:
    """`url` with its password replaced by `***` (redis://:s3cret@host:6379/0 -> redis://:***@host:6379/0);
    the rest unchanged, and a URL without a password returned as is."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def check_env_names(environ: Mapping[str, str]) -> None:
    """Raise SettingsError for a VRAMGUARD_* name that no setting has (pydantic-settings ignores
    them silently, so a typo like VRAMGUARD_MAX_BATCH would otherwise do nothing), or for an
    unknown per-model knob (VRAMGUARD_MODELS__<MODEL>__<KNOB>). The message names the variable
    and suggests the closest names; it points to SETTINGS_LIST rather than printing every name."""
    known = {name.upper() for name in Settings.model_fields}
    knobs = {name.upper() for name in ModelOverrides.model_fields}
    for key in environ:
        if not key.upper().startswith(ENV_PREFIX):
            continue
        parts = key[len(ENV_PREFIX) :].upper().split("__")
        if parts[0] not in known:
            raise SettingsError(f"unknown setting {key}; {_suggest_setting(parts[0], known, knobs)}")
        if parts[0] == "MODELS" and len(parts) >= 3 and parts[2] not in knobs:
            model = f"{ENV_PREFIX}MODELS__{parts[1]}__"
            guesses = difflib.get_close_matches(parts[2], knobs, n=3)
            raise SettingsError(f"unknown setting {key}; {_did_you_mean([model + g for g in guesses])}")


def _suggest_setting(name: str, known: set[str], knobs: set[str]) -> str:
    """The closest settings to the unknown `name` (upper case, no prefix): top-level ones, and
    per-model knobs spelled as their VRAMGUARD_MODELS__<MODEL>__ variable, since a knob such as
    MAX_BATCH_SIZE is often set without the model it belongs to."""
    guesses = difflib.get_close_matches(name, known | knobs, n=3)
    return _did_you_mean([f"{ENV_PREFIX}MODELS__<MODEL>__{g}" if g in knobs else ENV_PREFIX + g for g in guesses])


def _did_you_mean(names: list[str]) -> str:
    """The tail of an unknown-setting message: the suggestions, then where every name is listed."""
    if not names:
        return f"no setting has a similar name (every setting: {SETTINGS_LIST})"
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"did you mean {listed}? (every setting: {SETTINGS_LIST})"


def _describe(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for err in errors():
        loc = "__".join(str(p) for p in err.get("loc", ())).upper()
        name = f"{ENV_PREFIX}{loc}" if loc else "settings"
        parts.append(f"{name}: {err.get('msg')}")
    return "invalid settings: " + "; ".join(parts)
