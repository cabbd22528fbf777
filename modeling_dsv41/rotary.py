"""Partial RoPE of DeepSeek-V4.1: complex pairs on the last ``qk_rope_head_dim`` dims, YaRN on compressed layers.

Window-only layers rotate with ``rope_theta`` and no scaling; layers with compressed KV rotate every
token (window keys, queries and compressed latents alike) with ``compress_rope_theta`` and YaRN, because
one latent stands for several tokens. The output's rope slice gets the inverse rotation so that the
cached K=V vectors can stay in one shared rotated form.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_frequencies(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (fp32), with YaRN's ramp between ``beta_fast`` and ``beta_slow`` when given."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None or yarn.get("rope_type", "yarn") != "yarn":
        return freqs
    original, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def dim_for_rotations(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` turns into the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for_rotations(yarn["beta_fast"])), 0)
    high = min(math.ceil(dim_for_rotations(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


class DeepseekV41RotaryEmbedding(nn.Module):
    """One layer kind's rotations; ``forward(positions)`` gives complex rotations [..., dim/2].

    The fp32 frequencies are kept per device in a plain attribute rather than a buffer, so that a
    ``model.to(torch.bfloat16)`` can never round them, and built once per device rather than in every step.
    """

    def __init__(self, dim: int, theta: float, yarn: dict | None = None):
        super().__init__()
        self.dim, self.theta, self.yarn = dim, theta, yarn
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies [dim/2] (fp32) on ``device``; a compiled graph builds them in itself (constants)."""
        if torch.compiler.is_compiling():
            return rope_frequencies(self.dim, self.theta, self.yarn).to(device)
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_frequencies(self.dim, self.theta, self.yarn).to(device)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq(positions.device)
        return torch.polar(torch.ones_like(angles), angles)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, yarn={self.yarn}"


def apply_rotary(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2·rotation.size(-1)`` dims of ``x`` (adjacent pairs as complex numbers).

    x: [B, S, D] or [B, S, H, D]; rotation: [B, S, R] complex. Computed in fp32 and written back in x's dtype,
    the rotated slice rounded exactly as the reference's in-place rotation rounds it.
    """
    rd = 2 * rotation.size(-1)
    head, tail = x[..., :-rd], x[..., -rd:]
    if x.ndim == 4:
        rotation = rotation.unsqueeze(2)
    if torch.compiler.is_compiling():
        rotated = _rotate_real(tail.float(), rotation, inverse)
    else:
        if inverse:
            rotation = rotation.conj()
        pairs = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
        rotated = torch.view_as_real(pairs * rotation).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)


def _rotate_real(tail: torch.Tensor, rotation: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The complex product of :func:`apply_rotary` as cos/sin arithmetic on the pairs, for ``torch.compile``: inductor
    generates no code for complex ops (it falls back to eager kernels around them); agrees to fp32 rounding."""
    cos, sin = torch.view_as_real(rotation).unbind(-1)
    if inverse:
        sin = -sin
    real, imag = tail.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2)
