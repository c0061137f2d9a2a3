"""`SyntheticLMBackend`: a generative test model for the simulated device (worker/memory/simdevice.py),
so the KV plan is tested against an allocator that fails like CUDA's, without a GPU and without
a real model's CPU cost. It follows the same contract as causal_lm.py's CausalLMBackend.

A prompt's tokens are its words; the model answers token i+1 after token i (never its end
token, 0), so every sequence runs to max_tokens. Memory, as params say: weights_mib held from
load; per step step_fixed_mib + step_token_kib per token of the step (transient); the KV cache
kv_kib per token of every row at the batch's padded width, held while the rows live, and two
layers' copy of it (of `layers`) while it changes, as torch.cat / index_select copy a
DynamicCache layer by layer. step_ms: a sleep per step (no compute).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vramguard.shared.errors import InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.memory import simdevice
from vramguard.worker.memory.simalloc import Block
from vramguard.worker.memory.simdevice import SimDevice

KIB, MIB = 1024, 1024 * 1024
VOCAB = 1000
DEFAULTS = {"weights_mib": 64.0, "step_fixed_mib": 4.0, "step_token_kib": 64.0, "kv_kib": 64.0, "layers": 8.0,
            "step_ms": 1.0, "prefill_chunk_tokens": 64.0, "chunk_ms": 0.0}


class SimCache:
    """One sequence's cache while it is prefilled: `length` tokens of simulated memory."""

    def __init__(self, sim: SimDevice | None, bytes_per_token: int) -> None:
        self.sim, self.bytes_per_token, self.length = sim, bytes_per_token, 0
        self._blocks: list[Block] = []  # one per prefill chunk, as each chunk's tensors are

    def grow(self, tokens: int) -> None:
        if self.sim is not None:
            self._blocks.append(self.sim.allocate(tokens * self.bytes_per_token))
        self.length += tokens

    def free(self) -> None:
        if self.sim is not None:
            for block in self._blocks:
                self.sim.release(block)
        self._blocks.clear()
        self.length = 0


class SimKVBatch:
    """KVBatch's interface (kvbatch.py) on simulated memory: rows x padded width x bytes per token."""

    def __init__(self, sim: SimDevice | None, bytes_per_token: int, layers: int) -> None:
        self.sim, self.bytes_per_token, self.layers = sim, bytes_per_token, layers
        self.lengths: list[int] = []
        self._held = 0
        # One tensor per layer of rows x width tokens, as DynamicCache holds them.
        self._layers: list[Block | None] = [None] * layers

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def cache_bytes(self) -> int:
        return self._held

    def _resize(self) -> None:
        """Hold rows x width tokens; a change copies layer by layer (one layer's new copy at a time)."""
        wanted = self.rows * self.width * self.bytes_per_token
        # Also when nothing is wanted: a copy an OOM cut short may hold layers while _held is stale.
        if self.sim is not None and (wanted != self._held or not wanted):
            for i, old in enumerate(self._layers):  # each layer's new tensor is made before its old one goes
                self._layers[i] = self.sim.allocate(wanted // self.layers) if wanted else None
                if old is not None:
                    self.sim.release(old)
        self._held = wanted

    def join(self, cache: SimCache, length: int) -> None:
        self.lengths.append(length)
        self._resize()
        cache.free()

    def keep(self, rows: Sequence[int]) -> None:
        self.lengths = [self.lengths[r] for r in rows]
        self._resize()

    def step(self, forward: Any, tokens: Sequence[int]) -> torch.Tensor:
        self.lengths = [n + 1 for n in self.lengths]
        self._resize()
        return forward(list(tokens))  # type: ignore[no-any-return]


class SyntheticLMBackend:
    """See the module docstring. Params: DEFAULTS' keys."""

    simulates_memory = True  # on "sim" it declares its memory itself: no allocation mirror (worker/memory/mirror.py)

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        unknown = set(config.params) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"{settings.model}: unknown params {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        p = {**DEFAULTS, **config.params}
        self.name, self.device = settings.model, device
        self.weights_bytes = int(p["weights_mib"] * MIB)
        self.step_fixed_bytes, self.step_token_bytes = int(p["step_fixed_mib"] * MIB), int(p["step_token_kib"] * KIB)
        self.kv_bytes_per_token = int(p["kv_kib"] * KIB)
        self.kv_layers, self.step_ms = max(1, int(p["layers"])), p["step_ms"]
        self.prefill_chunk_tokens = int(p["prefill_chunk_tokens"])
        self.context_window = int(dict(settings.spec_for(settings.model).options).get("context_window", 4096))
        self.eos_token_ids = frozenset({0})
        self._sim: SimDevice | None = None

    @property
    def kv_tensors(self) -> int:
        """Tensors of the KV cache: one per layer (SimKVBatch), for the plan's fragmentation allowance."""
        return self.kv_layers

    def load(self) -> None:
        if self.device == "sim":
            self._sim = simdevice.current()
            self._sim.allocate(self.weights_bytes)

    # --- the batch contract: a prefill forward of the items -----------------------------------

    @property
    def max_item_cost(self) -> int:
        return self.prefill_chunk_tokens

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        return [self.prompt_ids(v, parameters)[-self.prefill_chunk_tokens:] for v in inputs]

    def item_cost(self, item: object) -> int:
        return max(1, len(item))  # type: ignore[arg-type]

    def sample_item(self, cost: int) -> object:
        return [1] * cost

    def collate(self, items: Sequence[object]) -> object:
        return [list(i) for i in items]  # type: ignore[call-overload]

    def forward(self, batch: object) -> object:
        rows: list[list[int]] = batch  # type: ignore[assignment]
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

    def new_cache(self) -> SimCache:
        return SimCache(self._sim, self.kv_bytes_per_token)

    def new_batch(self) -> SimKVBatch:
        return SimKVBatch(self._sim, self.kv_bytes_per_token, self.kv_layers)

    def prefill(self, ids: Sequence[int], start: int, cache: SimCache) -> torch.Tensor:
        cache.grow(len(ids))
        with self._step_memory(len(ids)):
            time.sleep(self.step_ms / 1000)
        return self._logits([ids[-1]])[0]

    def step_forward(self, tokens: list[int]) -> torch.Tensor:
        with self._step_memory(len(tokens)):
            time.sleep(self.step_ms / 1000)
        return self._logits(tokens)

    def _step_memory(self, tokens: int) -> Any:
        if self._sim is None:
            return _Nothing()
        return self._sim.transient(self.step_fixed_bytes + self.step_token_bytes * tokens)

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
