"""Linear layers whose computation is not a plain ``nn.Linear``: fp32 compute, and the block-diagonal ``wo_a``;
and the low-precision batched product they share with the indexer.

Consumers call these modules rather than reading their ``weight``, so that wrappers which replace a linear layer
(PEFT LoRA, quantization) either act on what the layer really computes or refuse it — never get silently skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def einsum_rounded_once(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """``torch.einsum`` accumulated in fp32 and rounded once to the operands' dtype.

    The reference's bf16 outputs were produced with torch 2.14, whose CPU bf16 batched GEMM rounds the exact fp32
    sum once; torch 2.13's rounds otherwise, one bf16 ulp off on some outputs (enough for the FP4 steps and the
    indexer's top-k to amplify). Computing in fp32 gives 2.14's bits on any version. fp32 operands, and operands
    on other devices (whose bf16 GEMMs accumulate in fp32 as the model's other linear layers there do), go to
    ``torch.einsum`` as they are: no fp32 copy of the weight per call.
    """
    dtype = operands[0].dtype
    if dtype == torch.float32 or operands[0].device.type != "cpu":
        return torch.einsum(equation, *operands)
    return torch.einsum(equation, *(t.float() for t in operands)).to(dtype)


class DeepseekV41Fp32Linear(nn.Linear):
    """A linear layer computed in fp32 whatever the input and weight dtypes, as the reference computes its
    ratio-2 compressor projections and the LM head. Output is fp32. Still an ``nn.Linear``, so LoRA applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


class DeepseekV41GroupedLinear(nn.Module):
    """Block-diagonal projection (the attention output's ``wo_a``): group ``g`` maps only its own slice of the input
    with its own ``[out_features, in_features]`` block. ``weight`` is stored as the checkpoint has it,
    ``[groups · out_features, in_features]``.

    Deliberately not an ``nn.Linear``: a wrapper treating ``weight`` as one dense matrix would compute something
    else, so PEFT refuses to put an adapter here ("Target module … is not supported").
    """

    def __init__(self, in_features: int, out_features: int, groups: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups, in_features] → [..., groups, out_features]."""
        weight = self.weight.view(self.groups, self.out_features, self.in_features)
        return einsum_rounded_once("...gd,grd->...gr", x, weight)

    def extra_repr(self) -> str:
        return (
            f"groups={self.groups}, in_features={self.in_features}, out_features={self.out_features} "
            "(per group; block-diagonal, cannot take a LoRA adapter)"
        )
