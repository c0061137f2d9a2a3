"""How a causal LM's weights are laid out when it runs on the CPU (worker/generate/causal_lm.py):
copied out of the loaded file, and each float32 linear layer given a second copy packed for
oneDNN, which multiplies a step's rows (2 and more) with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


class PackedLinear(torch.nn.Linear):
    """A float32 `nn.Linear` that also holds its weight reordered once into oneDNN's blocked layout
    (`packed`, an opaque mkldnn tensor: torch's `mkldnn._reorder_linear_weight`, the weight
    prepacking inductor's CPU freezing does), and multiplies with it when the input has two rows or
    more; one row goes to MKL's sgemv on `weight`, as in `nn.Linear`.

    Why both, measured on the 2-core AMD EPYC (AVX2, 1 thread, torch 2.13 with oneDNN 3.12 and MKL
    2024.2), SmolLM2-135M's decode steps, engines alternating step by step in one process, medians
    of 56-92 steps:
    - at 8 and 32 rows oneDNN on the packed weight is faster: whole steps 0.73-0.81x the time at 8
      sequences, 0.84-0.88x at 32; MKL's sgemm repacks the weight on every call, and on the
      49,152-wide output head it took 26 ms at 2 rows where it takes 11.5 at 1 (oneDNN: 13);
    - at one row MKL's sgemv is faster: whole steps 1.29-1.37x the time with oneDNN (each call into
      oneDNN costs about 40 us more before its kernel runs, 211 calls a step), and padding the row
      to two did not help.
    A row of a oneDNN product is the same bits whatever rows are beside it (measured: a row alone
    and in 2 to 295 rows, every weight shape of SmolLM2), so sequences stepped together do not
    change each other's tokens; MKL's sgemm does not give that (the same check: all 162 rows
    differed in some bit). A sequence decoding alone (one row, MKL) and beside others (oneDNN)
    still takes different kernels, so its greedy text can differ in a near tie, as it could before.

    The cost is a second copy of each weight (SmolLM2: the resident set grew by 1,301 MB while
    loading, against 694 MB with one copy, for a 540 MB file): the memory plan counts it, since it
    measures the weights as that growth."""

    packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.numel() == input.shape[-1]:  # one row
            return F.linear(input, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")
        return out


def lay_out_weights_for_cpu(model: PreTrainedModel) -> int:
    """Copy every weight and buffer out of the loaded file, and make each float32 `nn.Linear` a
    `PackedLinear` (the output head too, tied to the input embedding or not: the tie stays one
    `weight` tensor, the packed copy is the head's own). Without oneDNN in this torch build
    (`torch.backends.mkldnn.is_available()`) nothing is packed. Returns the number of layers packed.

    Why the copies: transformers maps a safetensors file into memory and the weights point into that
    mapping; one tensor left there keeps the whole file mapped, and its pages count in the resident
    set beside the copies (a process holding SmolLM2: 1.26 GB resident with the linear weights
    copied, 0.96 GB with nothing left in the mapping), which the memory plan on the CPU would take
    for weights; and weights left there become resident only as forwards touch them, so the plan,
    measuring the weights while loading, would count a fraction of them."""
    for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight once: parameters() de-duplicates
        tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            # The swap of class in place is how torch.nn.utils.parametrize extends a module: the
            # weight, its tie, hooks and the module's place in the model stay as they were.
            module.__class__ = PackedLinear
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            packed += 1
    return packed
