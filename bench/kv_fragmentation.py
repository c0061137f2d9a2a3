"""The KV pool against the caching allocator's fragmentation, on the simulated device: the synthetic
generative model (worker/generate/synthetic_lm.py) is started as a worker starts it (memory plan,
then the KV plan and its pool, allocated once) on a small simulated GPU, and its engine runs
continuous batching as the worker's GenerationServer does over random workloads: prompts of 1-60
tokens with 1-300 new tokens, arriving in bursts of 0-20 between steps.

The padded cache this replaced made each layer's tensor again at every step, join and leave, and
its plan needed an allowance for the holes that left in the allocator's segments (68 of 192
workloads ran out of memory without it). The pool is one tensor made once: the plan has no
allowance, and a full pool preempts instead of allocating. It reports, per shape (device MiB, KV
KiB per token, layers), the pool's tokens, the preemptions and how many workloads ran out of memory.

    python -m bench.kv_fragmentation [--workloads 16]
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
from vramguard.worker.generate.kvplan import KVPlan
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence
from vramguard.worker.generate.synthetic_lm import SyntheticLMBackend
from vramguard.worker.memory.budget import start_budget

MIB = 1024 * 1024
MAX_RUNNING = 64
SEQUENCES = 64
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
    """One shape: the pool's tokens, the preemptions, and the workloads that ran out of memory."""

    device_mib: int
    kv_kib: int
    layers: int
    tokens_fit: int
    preemptions: int
    workloads: int
    oom_workloads: int


def start(device_mib: int, kv_kib: int, layers: int) -> tuple[SyntheticLMBackend, KVPlan, KVPool]:
    """The model loaded on a fresh simulated GPU of `device_mib`, its KV plan and pool, as a worker
    with the default memory share makes them."""
    return start_synthetic(MODELS_FILE.format(max_running=MAX_RUNNING, kv_kib=kv_kib, layers=layers), device_mib,
                           MAX_RUNNING)


def start_synthetic(models_file: str, device_mib: int, max_running: int) -> tuple[SyntheticLMBackend, KVPlan, KVPool]:
    """The model `simlm` of `models_file` (a models file's TOML) loaded on a fresh simulated GPU of
    `device_mib`, its KV plan for `max_running` sequences and its pool, as a worker with the default
    memory share makes them."""
    with tempfile.TemporaryDirectory() as folder:
        models = Path(folder) / "models.toml"
        models.write_text(models_file)
        settings = Settings(model="simlm", models_file=str(models), device="sim", sim_memory_bytes=device_mib * MIB)
        config = settings.model_config_for("simlm")
        backend = SyntheticLMBackend(config, "sim", settings)
        budget = start_budget(backend, settings, config, register=False)
    plan, pool = build_kv_plan(backend, budget, max_running, config.params)
    return backend, plan, pool


def serve(backend: SyntheticLMBackend, plan: KVPlan, pool: KVPool, seed: int) -> tuple[str | None, int]:
    """One random workload through the engine; returns (the OOM message or None, preemptions)."""
    rng = random.Random(seed)
    waiting = [Sequence(request_id=RequestId(str(i)), entry_id=EntryId(str(i)), reply_to="bench", deadline_ms=1 << 62,
                        prompt_ids=[rng.randint(1, 9) for _ in range(rng.randint(1, 60))],
                        max_tokens=rng.randint(1, 300), sampling=SamplingParams(0.0, 1.0, seed))
               for i in range(SEQUENCES)]
    waiting = [s for s in waiting if plan.fits_alone(s.largest_tokens)]  # the others get 413 at once
    engine = Engine(backend, pool, plan.token_budget, plan.max_running)
    try:
        while waiting or engine.running or engine.waiting:
            for _ in range(min(rng.choice((0, 0, 0, 1, 2, 5, 9, 20)), len(waiting))):
                engine.add(waiting.pop(0))
            for seq in engine.step():
                seq.finish_if_done(backend.eos_token_ids)
            engine.remove({id(s) for s in engine.running if s.finish_reason is not None})
    except torch.cuda.OutOfMemoryError as exc:
        return str(exc), engine.preemptions
    return None, engine.preemptions


def run(device_mib: int, kv_kib: int, layers: int, workloads: int) -> Outcome:
    """`workloads` random workloads (seeds 0..workloads-1) on one shape, each on a fresh device."""
    ooms, preemptions, plan = 0, 0, None
    for seed in range(workloads):
        backend, plan, pool = start(device_mib, kv_kib, layers)
        oom, preempted = serve(backend, plan, pool, seed)
        ooms += oom is not None
        preemptions += preempted
    assert plan is not None
    return Outcome(device_mib, kv_kib, layers, plan.tokens_fit, preemptions, workloads, ooms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=int, default=16, help="random workloads per shape (default 16)")
    args = parser.parse_args()
    if args.workloads < 1:
        parser.error("--workloads must be at least 1")
    print("device_mib kv_kib layers tokens_fit preemptions oom_workloads")
    total = 0
    for shape in SHAPES:
        o = run(*shape, args.workloads)
        total += o.oom_workloads
        print(f"{o.device_mib:10} {o.kv_kib:6} {o.layers:6} {o.tokens_fit:10} {o.preemptions:11} "
              f"{o.oom_workloads:6}/{o.workloads}", flush=True)
    print(f"workloads that ran out of memory: {total} of {args.workloads * len(SHAPES)}")


if __name__ == "__main__":
    main()
