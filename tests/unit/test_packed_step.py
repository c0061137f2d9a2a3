"""A packed generation step (worker/generate/causal_lm.py, attention.py) computes what the model
computes for each sequence alone: a small random Llama, its paged KV pool, chunked prefills and
decodes of several sequences in one step, against plain forwards of each sequence's whole context;
each step's layout is worked out once, not once per layer; and the CPU's weight layout (a oneDNN
copy of each linear weight) changes no output, gives a row the same bits whatever rows are beside
it, and leaves no weight in the file it was loaded from."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vramguard.worker.generate import attention
from vramguard.worker.generate.attention import ATTENTION, StepLayout
from vramguard.worker.generate.causal_lm import packed_inputs
from vramguard.worker.generate.cpu_layout import PACKED_ROWS, PackedLinear, lay_out_weights_for_cpu
from vramguard.worker.generate.engine import Chunk
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def _seq(name: str, ids: list[int]) -> Sequence:
    return Sequence(request_id=name, entry_id=name, reply_to="", deadline_ms=0,  # type: ignore[arg-type]
                    prompt_ids=ids, max_tokens=8, sampling=SamplingParams(0.0, 1.0, 0))


def _last_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def _paged(num_blocks: int, monkeypatch: pytest.MonkeyPatch) -> tuple[LlamaForCausalLM, KVPool, list[StepLayout]]:
    """The untied model with the packed attention, a pool of `num_blocks` blocks of 4 tokens without
    prefix sharing, and the list every step's layout is recorded in."""
    model = _model(tied=False)
    model.set_attn_implementation(ATTENTION)
    pool = KVPool(model.config, num_blocks=num_blocks, block_tokens=4, device="cpu", dtype=torch.float32,
                  prefix_sharing=False)
    layouts: list[StepLayout] = []
    of = StepLayout.of
    monkeypatch.setattr(attention.StepLayout, "of", lambda *a: layouts.append(of(*a)) or layouts[-1])
    return model, pool, layouts


@pytest.mark.parametrize("tied", [False, True])
def test_packed_weights_keep_shapes_ties_and_outputs(tied: bool) -> None:
    model = _model(tied)
    ids = list(range(3, 23))
    before = _last_logits(model, ids)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    packed = lay_out_weights_for_cpu(model)
    assert packed == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.model.layers[1].mlp.down_proj, PackedLinear)
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied  # a tie stays one tensor
    torch.testing.assert_close(_last_logits(model, ids), before, rtol=1e-5, atol=1e-5)  # 20 rows: oneDNN
    assert torch.equal(_last_logits(model, ids[:1]), _last_logits(_model(tied), ids[:1]))  # 1 row: MKL, as before


def _ops(linear: torch.nn.Module, x: torch.Tensor) -> set[str]:
    with torch.profiler.profile() as prof:
        linear(x)
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize(("rows", "grad", "onednn"), [
    (1, False, False), (2, False, True), (32, False, True), (33, False, False), (8, True, False)])
def test_onednn_multiplies_2_to_32_rows_outside_autograd_and_mkl_the_rest(rows: int, grad: bool,
                                                                         onednn: bool) -> None:
    linear = torch.nn.Linear(64, 96)
    lay_out_weights_for_cpu(torch.nn.Sequential(linear))  # type: ignore[arg-type]
    x = torch.randn(1, rows, 64)  # [1, rows, in]: how a packed step passes its rows
    with torch.set_grad_enabled(grad):
        assert ("mkldnn::_linear_pointwise" in _ops(linear, x)) == onednn
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_multiplied_by_onednn_is_the_same_bits_beside_1_to_31_other_rows(bias: bool) -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536, bias=bias)
    assert lay_out_weights_for_cpu(torch.nn.Sequential(linear)) == 1  # type: ignore[arg-type]
    rows = torch.randn(32, 576)
    with torch.inference_mode():
        in_two = linear(rows[:2])[:1]
        assert all(torch.equal(linear(rows[:n])[:1], in_two) for n in range(3, 33))


def test_without_onednn_nothing_is_packed_and_weights_are_still_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = _model(tied=True)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert lay_out_weights_for_cpu(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(p.data_ptr() != pointers[name] for name, p in model.named_parameters())


def test_every_row_count_onednn_takes_is_built_while_loading() -> None:
    """oneDNN keeps what it builds for a new row count and weight shape (about 0.6 MB for SmolLM2's):
    built at load, the memory plan measures it with the weights; a step meeting a new count later
    would grow the worker past its plan."""
    layers = [torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576)]
    lay_out_weights_for_cpu(torch.nn.Sequential(*layers))  # type: ignore[arg-type]
    resident = _resident_bytes()
    with torch.inference_mode():
        for rows in PACKED_ROWS:
            for layer in layers:
                layer(torch.zeros(rows, layer.in_features))
    assert _resident_bytes() - resident < 8 * 2**20  # unbuilt: about 31 x 2 x 0.6 MB


def _resident_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def test_every_weight_and_buffer_leaves_the_loaded_file(tmp_path: Path) -> None:
    _model(tied=True).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    before = {name: t.data_ptr() for name, t in tensors.items()}
    lay_out_weights_for_cpu(model)
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {name for name, t in after.items() if t.data_ptr() == before[name]} == set()


def test_a_packed_step_of_prefill_chunks_and_decodes_matches_each_sequence_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, pool, layouts = _paged(32, monkeypatch)
    lay_out_weights_for_cpu(model)
    prompts = {"a": [5, 9, 2, 7, 11, 3, 8], "b": [4, 4, 6], "c": list(range(10, 30))}
    seqs = {name: _seq(name, ids) for name, ids in prompts.items()}
    for name, ids in prompts.items():
        assert pool.grow(name, len(ids) + 2)

    def step(chunks: list[Chunk]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(**packed_inputs(pool, chunks, "cpu")).logits[0]
        for chunk in chunks:
            pool.wrote(chunk.seq.request_id, [], len(chunk.tokens))  # no context: nothing to hash, no sharing
        return logits

    # Step 1: a and b prefill whole, c its first 6 tokens (a chunk of a longer prefill).
    first = step([Chunk(seqs["a"], 0, prompts["a"], True), Chunk(seqs["b"], 0, prompts["b"], True),
                  Chunk(seqs["c"], 0, prompts["c"][:6], False)])
    torch.testing.assert_close(first[0], _last_logits(model, prompts["a"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1], _last_logits(model, prompts["b"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[2], _last_logits(model, prompts["c"][:6]), rtol=1e-4, atol=1e-4)
    # Step 2: a and b decode one token each over their cache, c prefills the rest of its prompt.
    second = step([Chunk(seqs["a"], 7, [1], True), Chunk(seqs["b"], 3, [2], True),
                   Chunk(seqs["c"], 6, prompts["c"][6:], True)])
    torch.testing.assert_close(second[0], _last_logits(model, prompts["a"] + [1]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[1], _last_logits(model, prompts["b"] + [2]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[2], _last_logits(model, prompts["c"]), rtol=1e-4, atol=1e-4)
    assert len(layouts) == 2  # once a step, for both layers


def test_decodes_of_similar_length_share_one_padded_call_and_each_gets_its_own_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, pool, layouts = _paged(64, monkeypatch)
    lengths = {"short": 1, "a": 45, "b": 44, "c": 43, "d": 10}
    prompts = {name: [(7 * i + n) % 97 for i in range(n)] for name, n in lengths.items()}
    seqs = {name: _seq(name, ids) for name, ids in prompts.items()}
    for name, ids in prompts.items():
        assert pool.grow(name, len(ids) + 1)
    with torch.inference_mode():
        model(**packed_inputs(pool, [Chunk(seqs[n], 0, ids, True) for n, ids in prompts.items()], "cpu"))
    for name, ids in prompts.items():
        pool.wrote(name, [], len(ids))
    # One decode each, in an order the packing does not keep: a, b, c (46, 45 and 44 keys) are
    # attended in one call padded to 46; d (11 keys, 35 short of 46) starts a call of its own, which
    # short (2 keys) joins.
    order = ["short", "c", "a", "d", "b"]
    chunks = [Chunk(seqs[n], len(prompts[n]), [1], True) for n in order]
    with torch.inference_mode():
        logits = model(**packed_inputs(pool, chunks, "cpu")).logits[0]
    for row, name in enumerate(order):
        torch.testing.assert_close(logits[row], _last_logits(model, prompts[name] + [1]), rtol=1e-4, atol=1e-4)
    calls = layouts[-1].calls
    assert [(c.rows, c.queries, c.width) for c in calls] == [(3, 1, 46), (2, 1, 11)]
    assert [c.mask.sum(-1).flatten().tolist() for c in calls if c.mask is not None] == [[46, 45, 44], [11, 2]]


@pytest.mark.parametrize(("lengths", "sizes"), [
    ([], []),
    ([50] * 32, [32]),  # equal lengths: one call, no padding
    ([300, 290, 268, 267, 100, 9, 8], [3, 1, 1, 2]),  # 268 is 32 short of 300; 267 starts a group
    ([1000, 10, 10, 10], [1, 3]),  # a long context is never padded to
])
def test_decode_groups_pad_a_row_by_at_most_pad_keys(lengths: list[int], sizes: list[int]) -> None:
    assert attention.PAD_KEYS == 32
    assert attention.decode_groups(lengths) == sizes
