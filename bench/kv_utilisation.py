"""How full the KV pool runs when memory, not compute, bounds generation, against a reservation of
the worst case at admission (what the engine before the paged pool did), in the same pool.

The generation suite's mixed workload (bench/generate_mixed.py) cannot show this on the 2-core CPU:
SmolLM2's prefill there is the bound (32 prompts of 10,885 tokens take longer to prefill than their
answers take to generate), so the pool never fills (bench/ANALYSIS.md, "The mixed workload's two
missed targets"). Here the synthetic generative model (worker/generate/synthetic_lm.py, no compute
time) runs on the simulated GPU, its KV plan and pool made as a worker makes them, and the worker's
engine (worker/generate/engine.py) runs the same kind of workload with more requests, so memory binds
and stays bound:

- REQUESTS chat-like requests, all sent at once, prompts of 16 to 1,500 tokens spaced as the mixed
  workload's (`target_lengths`), each answering in 14 to 90 tokens (the range greedy SmolLM2 answers
  the mixed workload's prompts in) and then stopping, as at an end token; `max_tokens` the room left
  in the WINDOW-token context window, as a request without `max_tokens` gets;
- the pool capped at POOL_TOKENS (the tokens the generation suite's 384 MiB hold for SmolLM2 in
  float32) and the KV bytes per token of SmolLM2 in float32 (45 KiB), the token budget the plan sizes.

Two admission policies, the same pool and workload:

- paged: the engine as the worker runs it: a sequence is admitted when its prompt's blocks (plus
  one) are free, grows block by block, and the newest is preempted when the pool runs out;
- reserved: a request is handed to the same engine only while every running request's prompt +
  `max_tokens` fits in the pool together with its own: the worst case held from admission.

Sampled after every step: sequences running, and KV utilisation = tokens held (the running
sequences' written context, the worker's `kv_tokens_held`) / the pool's tokens (`tokens_fit`).
Reported over the steps where memory binds: a request waits and the pool has no room for it (its
prompt's blocks plus one free; for reserved, its prompt + max_tokens unreserved).

    python -m bench.kv_utilisation [--requests 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import deque
from dataclasses import dataclass

from bench.generate_mixed import target_lengths
from bench.kv_fragmentation import start_synthetic
from vramguard.shared.protocol import EntryId, RequestId
from vramguard.worker.generate.engine import Engine
from vramguard.worker.generate.kvplan import KVPlan
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence
from vramguard.worker.generate.synthetic_lm import SyntheticLMBackend

REQUESTS = 128
WINDOW = 2048  # SmolLM2's context window
POOL_TOKENS = 8736  # bench/generate.py's KV_POOL_BYTES (384 MiB) for SmolLM2 in float32, whole blocks
KV_KIB = 45  # SmolLM2's keys and values per token in float32: 2 x 30 layers x 3 heads x 64 x 4 bytes = 45 KiB
MAX_RUNNING = 64  # the generation suite's max_batch_size for the worker
DEVICE_MIB = 1024
ANSWER_TOKENS = (14, 90)
POLICIES = ("paged", "reserved")
MODELS_FILE = f"""
[simlm]
backend = "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend"
description = "synthetic generative model (KV utilisation bench)"
input_kind = "json"
output = {{ kind = "json", keys = ["next_token"] }}
options = {{ generates = true, context_window = {WINDOW} }}

[simlm.defaults]
max_batch_size = {MAX_RUNNING}
params = {{ kv_kib = {KV_KIB}, step_ms = 0.0, pool_tokens = {POOL_TOKENS} }}
"""


@dataclass(frozen=True, slots=True)
class Utilisation:
    """One policy over one workload. `bound_steps`: steps after which memory bound (a request waited
    with no room for it); over those, the median KV utilisation (0-1) and the median and most
    sequences running. `preemptions`: sequences the engine preempted. `steps`: all steps."""

    policy: str
    tokens_fit: int
    steps: int
    bound_steps: int
    kv_utilisation: float
    running_median: float
    running_max: int
    preemptions: int


def start() -> tuple[SyntheticLMBackend, KVPlan, KVPool]:
    """The synthetic model on a fresh simulated GPU of DEVICE_MIB, its KV plan and pool."""
    return start_synthetic(MODELS_FILE, DEVICE_MIB, MAX_RUNNING)


def workload(requests: int, seed: int) -> list[tuple[Sequence, int]]:
    """(sequence, answer tokens) for each request: prompts of target_lengths, max_tokens the room
    left in the window, answers of ANSWER_TOKENS drawn with `seed`."""
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(target_lengths(requests)):
        seq = Sequence(request_id=RequestId(str(i)), entry_id=EntryId(str(i)), reply_to="bench",
                       deadline_ms=1 << 62, prompt_ids=[rng.randint(1, 9) for _ in range(prompt)],
                       max_tokens=WINDOW - prompt, sampling=SamplingParams(0.0, 1.0, seed))
        out.append((seq, rng.randint(*ANSWER_TOKENS)))
    return out


def run(policy: str, requests: int = REQUESTS, seed: int = 0) -> Utilisation:
    """`policy` (POLICIES) over one workload on a fresh device; see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"policy is one of {POLICIES}, got {policy!r}")
    backend, plan, pool = start()
    engine = Engine(backend, pool, plan.token_budget, plan.max_running)
    pending = deque(workload(requests, seed))
    answers = {id(seq): answer for seq, answer in pending}
    reserved = 0  # prompt + max_tokens of the requests handed to the engine and not finished
    steps, samples = 0, []
    while pending or engine.running or engine.waiting:
        while pending and (policy == "paged" or reserved + pending[0][0].largest_tokens <= plan.tokens_fit):
            seq, _ = pending.popleft()
            reserved += seq.largest_tokens
            engine.add(seq)
        for seq in engine.step():
            if len(seq.generated) >= answers[id(seq)]:
                seq.finish_reason = "stop"  # the answer's end token
        done = [s for s in engine.running if s.finish_reason is not None]
        reserved -= sum(s.largest_tokens for s in done)
        engine.remove({id(s) for s in done})
        steps += 1
        if _memory_binds(policy, engine, pool, plan, pending, reserved):
            samples.append((engine.tokens_held() / plan.tokens_fit, len(engine.running)))
    running = [r for _, r in samples]
    return Utilisation(policy, plan.tokens_fit, steps, len(samples),
                       statistics.median(u for u, _ in samples) if samples else 0.0,
                       statistics.median(running) if running else 0.0, max(running, default=0), engine.preemptions)


def _memory_binds(policy: str, engine: Engine, pool: KVPool, plan: KVPlan,
                  pending: deque[tuple[Sequence, int]], reserved: int) -> bool:
    """A request waits and the pool has no room for it: for paged, the next waiting sequence's
    context blocks plus one are not free; for reserved, the next request's worst case is not."""
    if policy == "reserved":
        return bool(pending) and reserved + pending[0][0].largest_tokens > plan.tokens_fit
    if not engine.waiting:
        return False
    head = engine.waiting[0]
    return pool.free_blocks() < pool.blocks_for(len(head.context_ids)) + 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_utilisation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests sent at once (default {REQUESTS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' tokens and answers' lengths")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2")
    print("| policy | pool tokens | steps | steps memory bound | KV utilisation (bound, median) "
          "| running (bound, median / most) | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for policy in POLICIES:
        u = run(policy, args.requests, args.seed)
        print(f"| {u.policy} | {u.tokens_fit} | {u.steps} | {u.bound_steps} | {u.kv_utilisation:.1%} "
              f"| {u.running_median:g} / {u.running_max} | {u.preemptions} |", flush=True)


if __name__ == "__main__":
    main()
