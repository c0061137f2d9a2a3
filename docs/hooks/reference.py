"""MkDocs hook: the reference pages that have one source in the code are generated from it at build time.

A page asks for a generated part with a marker line, `<!-- generated: NAME -->`, replaced by:

- `settings`: every field of `shared/settings.py` `Settings` (environment variable, type and bounds,
  default, and the comments written beside the field in that file), grouped by the file's
  `# --- group ---` headings;
- `model-knobs`: the per-model knobs (`ModelOverrides`, described in `ModelConfig`'s docstring) and each
  built-in model's own defaults;
- `cli`: the `--help` of `vramguard` and each of its subcommands, and of `python -m vramguard.gateway`,
  as argparse prints them;
- `exit-codes`: the worker's exit codes (`ExitCode`) and the comment beside each;
- `metrics`: every series of a gateway's Prometheus registry (`gateway/observe/metrics.py` and the
  collector it registers), collected from a registry fed one worker of each kind, with type, labels and help.

It also keeps the hand-written pages honest: a `VRAMGUARD_*` name on any page that is neither a
setting, a per-model knob nor one of the launcher's own variables (NON_SETTINGS) is a warning, so
`mkdocs build --strict` fails on a renamed or misspelled setting. Hooks are MkDocs' own mechanism
(https://www.mkdocs.org/user-guide/configuration/#hooks): no plugin to pin.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import logging
import os
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.vramguard")  # under "mkdocs": --strict counts its warnings

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
SETTING_NAME = re.compile(r"\bVRAMGUARD_[A-Z0-9_]*[A-Z0-9]")
# VRAMGUARD_ names that are not settings of the services, and who reads them.
NON_SETTINGS = {
    "VRAMGUARD_REDIS_PORT": "the launcher's embedded Redis port (vramguard up --redis-port)",
    "VRAMGUARD_CPU_TORCH_PIP_ARGS": "docker-compose.yml: where the CPU worker image's torch comes from",
    "VRAMGUARD_DEVICE_LEDGER_HOST_DIR": "docker-compose.yml: the host folder mounted as the ledger",
}
HELP_COLUMNS = "80"  # argparse wraps --help at $COLUMNS; a code block of the theme shows about 80


def on_config(config: Any) -> Any:
    """Import the checkout the site is built from, not another installed vramguard."""
    sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = HELP_COLUMNS
    return config


def on_files(files: Any, config: Any) -> Any:
    """The benchmark's plot (written by `make bench` into bench/results/) joins the site as an asset."""
    from mkdocs.structure.files import File

    plot = ROOT / "bench" / "results" / "plot.png"
    if plot.exists():
        files.append(File.generated(config, "assets/bench-plot.png", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the page's markers, then check the VRAMGUARD_ names it mentions."""
    def fill(match: re.Match[str]) -> str:
        generator = GENERATORS.get(match.group(1))
        if generator is None:
            log.warning("%s: no generator named %r", page.file.src_uri, match.group(1))
            return match.group(0)
        return generator()

    markdown = MARKER.sub(fill, markdown)
    known = setting_names()
    for name in sorted(set(SETTING_NAME.findall(markdown)) - known):
        if is_model_knob(name):
            continue
        log.warning("%s names %s, which is not a setting (shared/settings.py) nor in NON_SETTINGS", page.file.src_uri,
                    name)
    return markdown


# --- settings ---

def setting_names() -> set[str]:
    """Every VRAMGUARD_ name a page may use: the settings, the per-model knobs' prefix, NON_SETTINGS."""
    from vramguard.shared.settings import ENV_PREFIX, Settings

    names = {env_name(name, field) for name, field in Settings.model_fields.items()}
    return {n for n in names if n.startswith(ENV_PREFIX)} | {f"{ENV_PREFIX}MODELS"} | set(NON_SETTINGS)


def is_model_knob(name: str) -> bool:
    """VRAMGUARD_MODELS__<MODEL>__<KNOB> for a real knob (shared/models.py ModelOverrides)."""
    from vramguard.shared.models import ModelOverrides

    parts = name.split("__")
    return len(parts) == 3 and parts[0] == "VRAMGUARD_MODELS" and parts[2].lower() in ModelOverrides.model_fields


def env_name(name: str, field: Any) -> str:
    """The environment variable of a Settings field: its first alias, else VRAMGUARD_<NAME>."""
    from pydantic import AliasChoices

    from vramguard.shared.settings import ENV_PREFIX

    alias = field.validation_alias
    return str(alias.choices[0]) if isinstance(alias, AliasChoices) else f"{ENV_PREFIX}{name.upper()}"


def field_comments(source: Path, class_name: str) -> tuple[dict[str, str], dict[str, str]]:
    """The comments of each field of `class_name` in `source`: the block right above it and the one
    at the end of its line(s), joined; and each field's group, the last `# --- group ---` above it."""
    text = source.read_text()
    comments = {tok.start[0]: (tok.start[1], tok.string.lstrip("#").strip())
                for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}
    lines = text.splitlines()
    alone = {row for row in comments if lines[row - 1].lstrip().startswith("#")}
    cls = next(node for node in ast.parse(text).body if isinstance(node, ast.ClassDef) and node.name == class_name)
    described: dict[str, str] = {}
    groups: dict[str, str] = {}
    group = ""
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in alone and comments[row][0] == node.col_offset:
            above.insert(0, comments[row][1])
            row -= 1
        heading = [c for c in above if c.startswith("---")]
        if heading:
            group = heading[-1].strip("- ")
            above = above[above.index(heading[-1]) + 1:]
        end = node.end_lineno or node.lineno
        after = [comments[r][1] for r in range(node.lineno, end + 1) if r in comments and r not in alone]
        if end in comments and end not in alone:  # a trailing comment continued below, in its column
            row = end + 1
            while row in alone and comments[row][0] == comments[end][0]:
                after.append(comments[row][1])
                row += 1
        described[node.target.id] = " ".join([*above, *after])
        groups[node.target.id] = group
    return described, groups


def shown(value: object) -> str:
    """A default as written in the environment (lists comma-separated, None as unset, booleans lower case)."""
    from vramguard.shared.settings import _shown

    return str(value).lower() if isinstance(value, bool) else _shown(value)


def bounds(field: Any) -> str:
    """The numeric bounds and pattern pydantic checks, as `>= 1, <= 64`."""
    marks = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out = []
    for meta in field.metadata:
        for attr, mark in marks.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{mark} {value}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return ", ".join(out)


def type_name(annotation: object) -> str:
    """A field's type as a reader writes it: `str | None`, `list[str]`, one of `"a"`, `"b"`."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    text = re.sub(r"pydantic\.types\.|vramguard\.[\w.]+\.", "", text)
    text = re.sub(r"Annotated\[(.+?), NoDecode\]", r"\1", text).replace("NoneType", "None")
    text = text.replace("SecretStr", "str (secret)")
    return re.sub(r"Literal\[(.+?)\]", lambda m: "one of " + m.group(1).replace("'", "`"), text)


def cell(text: str) -> str:
    """`text` for one table cell: pipes escaped, and `<`, `>` outside code spans kept as text, not HTML."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def settings_reference() -> str:
    from vramguard.shared.settings import Settings

    described, groups = field_comments(ROOT / "shared" / "settings.py", "Settings")
    by_group: dict[str, list[str]] = {}
    for name, field in Settings.model_fields.items():
        if name == "models":
            continue  # the per-model knobs, below
        if not described.get(name):
            log.warning("shared/settings.py: setting %s has no comment beside it to describe it", name)
        default = "" if field.is_required() else shown(field.get_default(call_default_factory=True))
        kind = type_name(field.annotation)
        limit = bounds(field)
        row = (f"| `{env_name(name, field)}` | {cell(kind)}{'; ' + cell(limit) if limit else ''} | "
               f"`{cell(default)}` | {cell(described.get(name, ''))} |")
        by_group.setdefault(groups.get(name) or "general", []).append(row)
    parts = []
    for group, rows in by_group.items():
        title = re.sub(r"\s*\([^)]*\)", "", group)  # "Redis topology (shared/redis_client.py): ..." without the file
        parts.append(f"### {title[:1].upper()}{title[1:]}\n\n| variable | type | default | what |\n"
                     "| --- | --- | --- | --- |\n" + "\n".join(rows))
    return "\n\n".join(parts)


def model_knobs_reference() -> str:
    from vramguard.shared.models import BUILTIN, ModelConfig, ModelOverrides

    doc = ModelConfig.__doc__ or ""
    described = {m.group(1): " ".join(m.group(2).split())
                 for m in re.finditer(r"^    (\w+): (.+?)(?=^    \w+: |\Z)", doc, re.MULTILINE | re.DOTALL)}
    base = ModelConfig()
    rows = []
    for name in ModelOverrides.model_fields:
        default = getattr(base, name)
        own = [f"{model} `{cell(shown(getattr(BUILTIN[model].defaults, name)))}`" for model in sorted(BUILTIN)
               if getattr(BUILTIN[model].defaults, name) != default]
        rows.append(f"| `{name.upper()}` | `{cell(shown(default))}` | {', '.join(own)} | "
                    f"{cell(described.get(name, ''))} |")
    return ("| knob | default | built-in models' own | what |\n| --- | --- | --- | --- |\n" + "\n".join(rows))


# --- CLI ---

def captured_help(run: Callable[[], object]) -> str:
    """What `run` prints to stdout before argparse's exit."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        run()
    return out.getvalue().rstrip()


def cli_reference() -> str:
    from vramguard.cli.main import build_parser
    from vramguard.gateway.__main__ import main as gateway_main
    from vramguard.worker.memory.profile import main as profile_main

    parser = build_parser()
    sections: list[tuple[str, Callable[[], object]]] = [("vramguard", lambda: parser.parse_args(["--help"]))]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in subparsers.choices:
        if name == "profile":
            sections.append(("vramguard profile", lambda: profile_main(["--help"], prog="vramguard profile")))
        else:
            sections.append((f"vramguard {name}", functools.partial(parser.parse_args, [name, "--help"])))
    # Not `python -m vramguard.worker --help`: its import takes torch (seconds), and what it adds to
    # the gateway's is the exit codes, generated from their source by `exit-codes` without importing it.
    sections.append(("python -m vramguard.gateway", lambda: gateway_main(["--help"])))
    return "\n\n".join(f"## `{title}`\n\n```text\n{captured_help(run)}\n```" for title, run in sections)


def exit_codes_reference() -> str:
    """The worker's `ExitCode` members and the comment beside each, read from the source (no import:
    the worker's modules take torch)."""
    for path in sorted((ROOT / "worker").rglob("*.py")):
        text = path.read_text()
        if "class ExitCode(" not in text:
            continue
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                             for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                             if tok.type == tokenize.COMMENT}
        cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == "ExitCode")
        rows = [f"| {ast.literal_eval(n.value)} | `{n.targets[0].id}` | {cell(comments.get(n.lineno, ''))} |"
                for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)]
        where = path.relative_to(ROOT)
        return f"| code | name (`{where}`) | meaning |\n| --- | --- | --- |\n" + "\n".join(rows)
    raise LookupError("no class ExitCode under worker/")


# --- metrics ---

def metrics_reference() -> str:
    """Collect a real gateway registry, fed one worker heartbeat that sets every field."""
    from vramguard.shared.metrics import PREFIX

    families: dict[str, Any] = {}
    for family in sample_registry().collect():
        families.setdefault(family.name, family)
    rows = []
    for name in sorted(families):
        family = families[name]
        shown_name = f"{name}_total" if family.type == "counter" else name
        labels = sorted({label for sample in family.samples for label in sample.labels if label != "le"})
        rows.append(f"| `{shown_name}` | {family.type} | {', '.join(f'`{x}`' for x in labels)} | "
                    f"{cell(family.documentation)} |")
    assert all(name.startswith(PREFIX) for name in families), families
    return "| series | type | labels | what |\n| --- | --- | --- | --- |\n" + "\n".join(rows)


def sample_registry() -> Any:
    """A GatewayMetrics registry (no Redis call is made) whose views hold one request, one queue,
    Redis' memory, and one generating worker whose heartbeat sets every field."""
    import json

    import redis.asyncio as aioredis

    from vramguard.gateway.observe.health import Health, HealthView
    from vramguard.gateway.observe.metrics import GatewayMetrics
    from vramguard.gateway.observe.queues import QueueStats, RedisMemory
    from vramguard.shared import metrics as m
    from vramguard.shared.heartbeat import WorkerBeat
    from vramguard.shared.keys import Keys
    from vramguard.shared.settings import Settings

    settings = Settings(served_models=["smollm2"], prometheus_multiproc_dir=None)
    redis = aioredis.Redis()  # never connected: nothing here awaits it
    health = Health(settings, redis, Keys())
    gateway = GatewayMetrics(settings, redis, Keys(), health)
    gateway.requests.labels("smollm2", "ok").inc()
    gateway.duration.labels("smollm2", "ok").observe(0.01)
    gateway.in_flight.labels("smollm2").set(0)
    snap = m.HistogramSnapshot(buckets=((1.0, 1.0), (float("inf"), 1.0)), sum=1.0)
    numbers: dict[str, Any] = {name: 1 for name, kind in WorkerBeat.__annotations__.items()
               if "int" in str(kind) or "float" in str(kind)}
    generation = {"kv_plan": {"kv_budget_bytes": 1}}
    beat = WorkerBeat(**{**numbers, "worker_id": "w", "model": "smollm2", "healthy": True, "state": "ready",
                         "histograms": m.encode_histograms({short: snap for short in m.HISTOGRAMS}),
                         "generation": json.dumps(generation)})
    health.view = HealthView(redis_ok=True, redis_error="", workers={"smollm2": {"w": beat}})
    gateway.cluster.queues = {"smollm2": QueueStats(waiting=0, pending=0, dead_letters=0, requests=0)}
    gateway.cluster.redis_memory = RedisMemory(used_bytes=1, maxmemory_bytes=0, policy="noeviction")
    return gateway.registry


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_reference,
    "model-knobs": model_knobs_reference,
    "cli": cli_reference,
    "exit-codes": exit_codes_reference,
    "metrics": metrics_reference,
}
