"""`SyntheticLMBackend`: a generative test model for the simulated device (worker/memory/simdevice.py),
so the KV plan is tested against an allocator that fails like CUDA's, without a GPU and without
a real model's CPU cost. It follows the same contract as causal_lm.py's CausalLMBackend.

A prompt's tokens are its words; the model answers token i+1 after token i (never its end
token, 0), so every sequence runs to max_tokens. Memory, as params say: weights_mib held from
load; per step step_fixed_mib + step_token_kib per token the step computes + read_kib per cached
token it reads (transient: the keys and values a real attention reads back); the KV pool kv_kib per
token, taken from the simulated allocator once when the pool is made (kvpool.py's block bookkeeping
runs on the `meta` device, without storage). step_ms: a sleep per step (no compute); layers: kept
for older models files (one pool tensor has no per-layer copies). hold_step (tests): 1 lets a test
hold one step, or break one worker's device, by creating a file (worker/generate/stephold.py);
fail_token (tests): a step that computes this token raises, as a model failing on one input does
(0, the default: never; a word of n letters is token n + 1). Also the params of every
generative model (kvplan.GENERATION_PARAMS).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import LlamaConfig

from vramguard.shared.errors import InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.generate.engine import Chunk
from vramguard.worker.generate.kvplan import GENERATION_PARAMS
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.stephold import DeviceBreak, StepHold, hold_path
from vramguard.worker.memory import simdevice
from vramguard.worker.memory.simdevice import SimDevice

KIB, MIB = 1024, 1024 * 1024
VOCAB = 1000
DEFAULTS = {"weights_mib": 64.0, "step_fixed_mib": 4.0, "step_token_kib": 64.0, "read_kib": 1.0, "kv_kib": 64.0,
            "layers": 8.0, "step_ms": 1.0, "max_step_tokens": 256.0, "chunk_ms": 0.0, "fail_token": 0.0}


class SyntheticLMBackend:
    """See the module docstring. Params: DEFAULTS' keys."""

    simulates_memory = True  # on "sim" it declares its memory itself: no allocation mirror (worker/memory/mirror.py)

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        params = dict(config.params)
        hold = hold_path(settings.key_prefix, settings.model) if params.pop("hold_step", 0) else None
        self._hold, self._break = StepHold(hold), DeviceBreak(hold and hold + ".break")
        unknown = set(params) - set(DEFAULTS) - GENERATION_PARAMS
        if unknown:
            raise ValueError(f"{settings.model}: unknown params {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        p = {**DEFAULTS, **{k: v for k, v in params.items() if k in DEFAULTS}}
        self.name, self.device = settings.model, device
        self.weights_bytes = int(p["weights_mib"] * MIB)
        self.step_fixed_bytes, self.step_token_bytes = int(p["step_fixed_mib"] * MIB), int(p["step_token_kib"] * KIB)
        self.kv_bytes_per_token, self.read_bytes_per_token = int(p["kv_kib"] * KIB), int(p["read_kib"] * KIB)
        self.kv_layers, self.step_ms = max(1, int(p["layers"])), p["step_ms"]
        self.max_step_tokens = int(p["max_step_tokens"])
        self._fail_token = int(p["fail_token"])
        if self.kv_bytes_per_token % 4 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"{settings.model}: kv_kib x 1024 must be a positive multiple of 4 bytes (float16 keys "
                             "and values)")
        self.context_window = int(dict(settings.spec_for(settings.model).options).get("context_window", 4096))
        self.eos_token_ids = frozenset({0})
        self._sim: SimDevice | None = None

    def load(self) -> None:
        if self.device == "sim":
            self._sim = simdevice.current()
            self._sim.allocate(self.weights_bytes)

    # --- the batch contract: a prefill forward of the items -----------------------------------

    @property
    def max_item_cost(self) -> int:
        return self.max_step_tokens

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        return [self.prompt_ids(v, parameters)[-self.max_step_tokens:] for v in inputs]

    def item_cost(self, item: object) -> int:
        return max(1, len(item))  # type: ignore[arg-type]

    def sample_item(self, cost: int) -> object:
        return [1] * cost

    def collate(self, items: Sequence[object]) -> object:
        return [list(i) for i in items]  # type: ignore[call-overload]

    def forward(self, batch: object) -> object:
        rows: list[list[int]] = batch  # type: ignore[assignment]
        self._break()
        with self._step_memory(len(rows) * max(len(r) for r in rows)):
            time.sleep(self.step_ms / 1000)
        return [self._next(r[-1]) for r in rows]

    def split(self, outputs: object, n_items: int) -> list[object]:
        if len(outputs) != n_items:  # type: ignore[arg-type]
            raise ModelError(f"{len(outputs)} outputs for {n_items} items")  # type: ignore[arg-type]
        return list(outputs)  # type: ignore[call-overload,no-any-return]

    def encode(self, item: object, output: object) -> object:
        return {"next_token": int(output)}  # type: ignore[call-overload]

    def example_inputs(self) -> list[object]:
        return ["warm up"]

    # --- generation ---------------------------------------------------------------------------

    def prompt_ids(self, value: object, parameters: Mapping[str, object]) -> list[int]:
        if isinstance(value, list):
            value = " ".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
        if not isinstance(value, str) or not value.split():
            raise InvalidInputError("a prompt is a non-empty string or a list of messages")
        return [1 + (len(w) % (VOCAB - 1)) for w in value.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(f" w{i}" for i in ids if i not in self.eos_token_ids)

    def new_pool(self, num_blocks: int, block_tokens: int, prefix_sharing: bool = True) -> KVPool:
        """The KV pool's blocks (kvpool.py, on the meta device) and, on the simulated device, its
        bytes taken from the simulated allocator in one allocation, as a real pool's one tensor."""
        head_dim = self.kv_bytes_per_token // 4  # float16 keys and values; the layers' split does not matter here
        config = LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                             head_dim=head_dim, hidden_size=head_dim, vocab_size=VOCAB)
        pool = KVPool(config, num_blocks, block_tokens, "meta", torch.float16, prefix_sharing=prefix_sharing)
        if self._sim is not None:
            sim, block = self._sim, self._sim.allocate(pool.bytes)
            pool._on_close = lambda: sim.release(block)
        return pool

    def forward_step(self, pool: KVPool, chunks: Sequence[Chunk]) -> torch.Tensor:
        """One step: a sleep, transient memory for the tokens it computes and the cached tokens it
        reads, and each chunk's next token. Returns [len(chunks), vocab] logits."""
        computed = sum(len(c.tokens) for c in chunks)
        read = sum(c.past for c in chunks)
        self._hold()
        self._break()
        if self._fail_token and any(self._fail_token in c.tokens for c in chunks):
            raise RuntimeError(f"the synthetic LM fails on token {self._fail_token} (fail_token)")
        with self._step_memory(computed, read):
            time.sleep(self.step_ms / 1000)
        return self._logits([c.tokens[-1] for c in chunks])

    def _step_memory(self, tokens: int, read: int = 0) -> Any:
        if self._sim is None:
            return _Nothing()
        return self._sim.transient(self.step_fixed_bytes + self.step_token_bytes * tokens
                                   + self.read_bytes_per_token * read)

    @staticmethod
    def _next(token: int) -> int:
        return 1 + token % (VOCAB - 1)  # never 0, the end token

    def _logits(self, tokens: Sequence[int]) -> torch.Tensor:
        logits = torch.zeros((len(tokens), VOCAB))
        for row, token in enumerate(tokens):
            logits[row, self._next(token)] = 1.0
        return logits


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
