"""RMSNorm as DeepSeek-V4.1 computes it: statistics in fp32, result cast back to the input dtype."""

import torch
from torch import nn

from .recompute import recomputed


class DeepseekV41RMSNorm(nn.Module):
    """``weight · x / rms(x)`` over the last dim; the product is taken in fp32 before the cast (reference order).
    Recomputed in the backward (:func:`~.recompute.recomputed`): it keeps x, not its fp32 copy and normalized form."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._normalize, x, self.weight)

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (weight * x).to(dtype)  # a bf16 weight is promoted inside the product: its exact fp32 value

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
