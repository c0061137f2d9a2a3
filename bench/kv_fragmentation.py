"""The KV cache against the caching allocator's fragmentation, on the simulated device: the synthetic
generative model (worker/generate/synthetic_lm.py) is started as a worker starts it (memory plan,
then KV plan) on a small simulated GPU, and its engine runs continuous batching as the worker's
GenerationServer does (a sequence joins while the KV plan admits it) over random workloads:
prompts of 1-60 tokens with 1-300 new tokens, arriving in bursts of 0-20 between steps. Every
decode step re-makes each layer's cache tensor one column wider, as torch.cat does in a
DynamicCache, so the allocator's segments fill with holes (worker/memory/simalloc.py).

It reports, per shape (device MiB, KV KiB per token, layers), the tokens the plan holds, the
fragmentation allowance it set aside, and how many workloads ran out of memory: with the
allowance, and without it (`--no-allowance`: the plan of bytes alone).

    python -m bench.kv_fragmentation [--workloads 16] [--no-allowance]
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vramguard.shared.protocol import EntryId, RequestId
from vramguard.shared.settings import Settings
from vramguard.worker.generate.engine import Engine
from vramguard.worker.generate.kvmeasure import build_kv_plan
from vramguard.worker.generate.kvplan import KVPlan, plan_kv
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence
from vramguard.worker.generate.synthetic_lm import SyntheticLMBackend
from vramguard.worker.memory.budget import start_budget

MIB = 1024 * 1024
MAX_RUNNING = 64
SEQUENCES = 64
DERIVED = frozenset({"kv_budget_bytes", "tokens_fit", "fragmentation_bytes"})  # KVPlan fields plan_kv computes
SHAPES = tuple(itertools.product((256, 512), (16, 64, 256), (4, 8, 16, 30)))  # device MiB, KV KiB/token, layers
MODELS_FILE = """
[simlm]
backend = "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend"
description = "synthetic generative model (fragmentation bench)"
input_kind = "json"
output = {{ kind = "json", keys = ["next_token"] }}
options = {{ generates = true, context_window = 4096 }}
defaults = {{ max_batch_size = {max_running}, params = {{ kv_kib = {kv_kib}, layers = {layers}, step_ms = 0.0 }} }}
"""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One shape: the plan's tokens and allowance (bytes), and the workloads that ran out of memory."""

    device_mib: int
    kv_kib: int
    layers: int
    tokens_fit: int
    fragmentation_bytes: int
    workloads: int
    oom_workloads: int


def start(device_mib: int, kv_kib: int, layers: int, *, allowance: bool = True) -> tuple[SyntheticLMBackend, KVPlan]:
    """The model loaded on a fresh simulated GPU of `device_mib` and its KV plan, as a worker with the
    default memory share plans it (`allowance` False: without the fragmentation allowance)."""
    with tempfile.TemporaryDirectory() as folder:
        models = Path(folder) / "models.toml"
        models.write_text(MODELS_FILE.format(max_running=MAX_RUNNING, kv_kib=kv_kib, layers=layers))
        settings = Settings(model="simlm", models_file=str(models), device="sim", sim_memory_bytes=device_mib * MIB)
        config = settings.model_config_for("simlm")
        backend = SyntheticLMBackend(config, "sim", settings)
        budget = start_budget(backend, settings, config, register=False)
    plan = build_kv_plan(backend, budget, MAX_RUNNING)
    return backend, plan if allowance else without_allowance(plan)


def without_allowance(plan: KVPlan) -> KVPlan:
    """The same plan of bytes alone, as if the cache's tensors left no holes."""
    inputs = {k: v for k, v in plan.as_dict().items() if k not in DERIVED}
    return plan_kv(**inputs, cache_tensors=0)  # type: ignore[arg-type]


def serve(backend: SyntheticLMBackend, plan: KVPlan, seed: int) -> str | None:
    """One random workload through the engine; returns the OOM message, or None when all finished."""
    rng = random.Random(seed)
    waiting = [Sequence(request_id=RequestId(str(i)), entry_id=EntryId(str(i)), reply_to="bench", deadline_ms=1 << 62,
                        prompt_ids=[rng.randint(1, 9) for _ in range(rng.randint(1, 60))],
                        max_tokens=rng.randint(1, 300), sampling=SamplingParams(0.0, 1.0, seed))
               for i in range(SEQUENCES)]
    waiting = [s for s in waiting if plan.admits([], s.reserved_tokens)]  # the others get 413 at once
    engine, pending = Engine(backend), list[Sequence]()
    try:
        while waiting or pending or engine.running or engine.joining:
            for _ in range(min(rng.choice((0, 0, 0, 1, 2, 5, 9, 20)), len(waiting))):
                pending.append(waiting.pop(0))
            while pending:  # GenerationServer.admit's rule
                reserved = [s.reserved_tokens for s in (*engine.running, *(s for s, _ in engine.joining))]
                if not plan.admits(reserved, pending[0].reserved_tokens):
                    break
                engine.add(pending.pop(0))
            engine.texts(engine.step(), backend.eos_token_ids)
            engine.remove({id(s) for s in engine.running if s.finish_reason is not None})
    except torch.cuda.OutOfMemoryError as exc:
        return str(exc)
    return None


def run(device_mib: int, kv_kib: int, layers: int, workloads: int, *, allowance: bool = True) -> Outcome:
    """`workloads` random workloads (seeds 0..workloads-1) on one shape, each on a fresh device."""
    ooms, plan = 0, None
    for seed in range(workloads):
        backend, plan = start(device_mib, kv_kib, layers, allowance=allowance)
        ooms += serve(backend, plan, seed) is not None
    assert plan is not None
    return Outcome(device_mib, kv_kib, layers, plan.tokens_fit, plan.fragmentation_bytes, workloads, ooms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=int, default=16, help="random workloads per shape (default 16)")
    parser.add_argument("--no-allowance", action="store_true", help="plan without the fragmentation allowance")
    args = parser.parse_args()
    if args.workloads < 1:
        parser.error("--workloads must be at least 1")
    print("device_mib kv_kib layers tokens_fit allowance_mib oom_workloads")
    total = 0
    for shape in SHAPES:
        o = run(*shape, args.workloads, allowance=not args.no_allowance)
        total += o.oom_workloads
        print(f"{o.device_mib:10} {o.kv_kib:6} {o.layers:6} {o.tokens_fit:10} {o.fragmentation_bytes / MIB:13.1f} "
              f"{o.oom_workloads:6}/{o.workloads}", flush=True)
    print(f"workloads that ran out of memory: {total} of {args.workloads * len(SHAPES)}")


if __name__ == "__main__":
    main()
