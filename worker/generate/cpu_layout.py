"""How a causal LM's weights are laid out when it runs on the CPU (worker/generate/causal_lm.py):
copied out of the loaded file, and each float32 linear layer given a second copy packed for
oneDNN, which multiplies a decode step's 2 to 32 rows (PACKED_ROWS) with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

# The row counts oneDNN multiplies; one row and more than 32 go to MKL. oneDNN keeps what it builds
# for each new row count and weight shape for good (about 0.6-1.1 MB and 2-8 ms the first time: every
# count from 2 to 399 on one SmolLM2 weight shape grew the resident set by 255 MB), while a step's
# rows run from 1 to the token budget; counts up to 32 are what decode steps have, and all of them
# are built at load (warm_packed), where the memory plan measures the weights: for SmolLM2's 5
# shapes the resident set at load grew by 1,474 MB instead of 1,300, and loading took 8-10 s
# instead of 7 (up to 64 rows would double that). Above 32 rows (prefill chunks, more than 32
# decodes) the two measured even or MKL ahead on the decoder layers' products (the 30 layers at
# 48 rows 207.5 ms both, at 128 420 against 431).
PACKED_ROWS = range(2, 33)


class PackedLinear(torch.nn.Linear):
    """A float32 `nn.Linear` that also holds its weight reordered once into oneDNN's blocked layout
    (`packed`, an opaque mkldnn tensor made by torch's `mkldnn._reorder_linear_weight`), and
    multiplies with it an input of PACKED_ROWS rows (input [..., in_features], float32, rows = the
    product of the leading dims) outside autograd; everything else goes to `F.linear` on `weight`,
    as in `nn.Linear` (MKL's sgemv for one row).

    Why both, measured on the 2-core AMD EPYC (AVX2, 1 thread, torch 2.13 with oneDNN 3.12 and MKL
    2024.2), SmolLM2-135M's decode steps, engines alternating step by step in one process, medians
    of 56-92 steps:
    - at 8 and 32 rows oneDNN on the packed weight is faster: whole steps 0.73-0.81x the time at 8
      sequences, 0.84-0.88x at 32; MKL's sgemm repacks the weight on every call, and on the
      49,152-wide output head it took 26 ms for 2 rows where it takes 11.5 for 1 (oneDNN: 13 for 2);
    - at one row MKL's sgemv is faster: whole steps 1.29-1.37x the time with oneDNN (a call into
      oneDNN through torch takes 58 us where its kernel takes 16, 211 calls a step, and its kernel
      reading a cold weight was slower too), and padding the row to two did not help.
    A row of a oneDNN product is the same bits whatever rows are beside it (measured: 0 of 110
    checks differed, a row in 1 to 295 rows, every weight shape of SmolLM2), so the linear layers of
    a step of 2 to 32 rows do not change one sequence's numbers by the others beside it; MKL's
    sgemm does not give that (all 162 of the same kind of checks differed in some bit). A sequence
    decoding alone (one row, MKL) and beside others (oneDNN) still takes different kernels, so its
    greedy text can differ in a near tie, as it could before.

    The model is frozen once laid out: `packed` is not moved, cast, saved nor updated with
    `weight` (`.to()`, `load_state_dict` and in-place changes leave it stale; deepcopy fails). The
    worker never does any of these after loading."""

    packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[:-1].numel() in PACKED_ROWS and not torch.is_grad_enabled():  # oneDNN has no backward
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")
            return out
        return F.linear(input, self.weight, self.bias)


def lay_out_weights_for_cpu(model: PreTrainedModel) -> int:
    """Copy every weight and buffer out of the loaded file, and make each float32 layer of exactly
    class `nn.Linear` (not a subclass, whose forward may differ) a `PackedLinear`, the output head
    too (tied to the input embedding or not: the tie stays one `weight` tensor, the packed copy is
    the head's own); then warm_packed. Without oneDNN in this torch build
    (`torch.backends.mkldnn.is_available()`) nothing is packed. Returns the number of layers packed.

    Why the copies: transformers maps a safetensors file into memory and the weights point into that
    mapping; one tensor left there keeps the whole file mapped, and its pages count in the resident
    set beside the copies (a process holding SmolLM2, before packing: 1.26 GB resident with the
    linear weights copied, 0.96 GB with nothing left in the mapping), which the memory plan on the
    CPU would take for weights; and weights left there become resident only as forwards touch
    them, so the plan, measuring the weights while loading, would count a fraction of them.

    The packed copies cost memory, which the plan counts (it measures the weights as the resident
    set's growth while loading): SmolLM2's grew by 1,474 MB (the packed copies and what warm_packed
    builds) against 694 MB with one copy, for a 540 MB file."""
    for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight once: parameters() de-duplicates
        tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return 0
    packed: list[PackedLinear] = []
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            # The swap of class in place is how torch.nn.utils.parametrize extends a module: the
            # weight, its tie, hooks and the module's place in the model stay as they were.
            module.__class__ = PackedLinear
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            packed.append(module)  # type: ignore[arg-type]
    warm_packed(packed)
    return len(packed)


def warm_packed(layers: list[PackedLinear]) -> None:
    """Multiply zeros of every row count in PACKED_ROWS by one layer of each distinct (in, out,
    bias) shape, so that oneDNN builds what it keeps for each now (PACKED_ROWS says why)."""
    shapes = {(m.in_features, m.out_features, m.bias is not None): m for m in layers}
    with torch.inference_mode():
        for layer in shapes.values():
            for rows in PACKED_ROWS:
                layer(torch.zeros(rows, layer.in_features))
