"""DeepSeek-ViT, the 3×3 aligner into the LM width, and the merge of image features into the LM input.

The ViT differs from a standard ViT in four ways (docs/design.md §1, §5): 2D RoPE instead of learned positions (so
any grid size works), a linear patch embedding instead of a convolution, RMSNorm pre-norm and a SwiGLU FFN.
Attention is bidirectional inside one image and never crosses images.

Every image runs through the ViT and the aligner on its own. This is what the reference does, and it is
the only way to guarantee that an image's features do not depend on what else is in the batch: CPU and GPU
GEMM kernels are picked by the number of rows, so a row's result can change in the last bit when other
images' rows are stacked into the same matrix.

Module and parameter names follow the released checkpoint (``vision.*``, ``aligner.*``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from processing.image_tokens import ImageTokenType, span_length, token_grid

from .validation import count

# the token types of an image span (plain ints: see ImageTokenType)
TEXT, START, IMAGE, NEWLINE, END = (kind.value for kind in ImageTokenType)


def vision_rotary_cos_sin(
    grid_h: int, grid_w: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables for a row-major ``grid_h × grid_w`` patch grid, fp32, each ``[h·w, 1, head_dim/2]``.

    Half of the rotary angles follow the patch row and half the patch column: each axis gets
    ``head_dim/4`` frequencies of a ``head_dim/2``-dimensional RoPE, row frequencies first.
    """
    axis_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32, device=device) / axis_dim))
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, device=device).repeat(grid_h)
    positions = torch.stack([rows, cols], dim=-1).float()  # [h·w, 2]
    angles = (positions.unsqueeze(-1) * inv_freq).flatten(1)  # [h·w, head_dim/2]: row angles | column angles
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32: dimension ``i`` pairs with ``i + head_dim/2``. x: [N, heads, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DeepseekV41VisionRMSNorm(nn.Module):
    """RMSNorm computed in fp32 with an fp32 weight (the checkpoint stores the ViT norms in fp32)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(hidden_states.dtype)


class DeepseekV41VisionPatchEmbed(nn.Module):
    """A linear map of each flattened 3×p×p patch (a linear layer rather than a convolution, so that
    Muon can train it as a matrix)."""

    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.flatten(1))


class DeepseekV41VisionAttention(nn.Module):
    """Full bidirectional multi-head attention over the patches of one image, with 2D RoPE on q and k."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, output_attentions: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[n, C] → [n, C]; with ``output_attentions`` also the attention map [heads, n, n] (computed beside the
        fused kernel, which does not return it, so the output is the same bits either way)."""
        n = hidden_states.shape[0]  # patches of one image
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.wqkv(hidden_states).chunk(3, dim=-1))
        q = apply_vision_rotary(q, cos, sin)
        k = apply_vision_rotary(k, cos, sin)
        # [1, heads, n, head_dim]: the 4D layout lets SDPA use its fused kernels (flash on CPU, as the reference)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = self.wo(F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, -1))
        if not output_attentions:
            return out
        probs = (q[0].float() @ k[0].float().transpose(-1, -2) * self.head_dim**-0.5).softmax(dim=-1)
        return out, probs.to(q.dtype)


class DeepseekV41VisionMLP(nn.Module):
    """SwiGLU FFN; ``w1`` holds the gate and up projections stacked (gate first)."""

    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(hidden_states).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DeepseekV41VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DeepseekV41VisionAttention(config)
        self.norm2 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekV41VisionMLP(config)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, output_attentions: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[n, C] → [n, C]; with ``output_attentions`` also the attention map [heads, n, n]."""
        attn = self.attn(self.norm1(hidden_states), cos, sin, output_attentions)
        attn, probs = attn if output_attentions else (attn, None)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.mlp(self.norm2(hidden_states))
        return (hidden_states, probs) if output_attentions else hidden_states


def _check_grids(pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> list[tuple[int, int]]:
    if image_grid_hw.ndim != 2 or image_grid_hw.shape[1] != 2:
        raise ValueError(f"image_grid_hw must be [n_images, 2], got shape {tuple(image_grid_hw.shape)}")
    grids = [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
    if any(h <= 0 or w <= 0 for h, w in grids):
        raise ValueError(f"every image grid must be at least 1×1, got {grids}")
    total = sum(h * w for h, w in grids)
    if pixel_values.shape[0] != total:
        raise ValueError(
            f"pixel_values holds {pixel_values.shape[0]} patches but image_grid_hw {grids} adds up to {total}"
        )
    return grids


class DeepseekV41VisionTransformer(nn.Module):
    """DeepSeek-ViT. Images of any size are encoded independently of each other."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.patch_embed = DeepseekV41VisionPatchEmbed(config)
        self.blocks = nn.ModuleList(DeepseekV41VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: [total_patches, 3, p, p], each image's patches row-major, images concatenated;
        image_grid_hw: [n_images, 2] patch rows and columns. Returns one [h·w, hidden_size] per image."""
        return [features for features, _, _ in self.encode(pixel_values, image_grid_hw)]

    def encode(
        self,
        pixel_values: torch.Tensor,
        image_grid_hw: torch.Tensor,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> list[tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor] | None]]:
        """As :meth:`forward`, per image: (features, its hidden states, its attention maps). The hidden states are
        the patch embeddings then each block's output [h·w, hidden_size] (``num_hidden_layers + 1``, before the
        final ``norm``); the maps are each block's [heads, h·w, h·w]. ``None`` unless asked for."""
        p = self.config.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, p, p):
            raise ValueError(
                f"pixel_values must be [total_patches, {self.config.num_channels}, {p}, {p}], "
                f"got shape {tuple(pixel_values.shape)}"
            )
        grids = _check_grids(pixel_values, image_grid_hw)
        pixel_values = pixel_values.to(self.patch_embed.proj.weight.dtype)
        patches = pixel_values.split([h * w for h, w in grids])
        return [
            self._encode_image(x, h, w, output_hidden_states, output_attentions) for x, (h, w) in zip(patches, grids)
        ]

    def _encode_image(
        self, pixel_values: torch.Tensor, grid_h: int, grid_w: int, output_hidden_states: bool, output_attentions: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """One image: [h·w, 3, p, p] → ([h·w, hidden_size], hidden states, attention maps)."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        cos, sin = vision_rotary_cos_sin(grid_h, grid_w, head_dim, self.config.rope_theta, pixel_values.device)
        hidden_states = self.patch_embed(pixel_values)
        all_hidden = [hidden_states] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for block in self.blocks:
            hidden_states = block(hidden_states, cos, sin, output_attentions)
            if output_attentions:
                hidden_states, probs = hidden_states
                all_attentions.append(probs)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        return self.norm(hidden_states), all_hidden, all_attentions


def unfold_token_grid(features: torch.Tensor, grid_h: int, grid_w: int, ratio: int) -> torch.Tensor:
    """[h·w, C] patch features → [ceil(h/r)·ceil(w/r), C·r·r]: zero-pad bottom/right to a multiple of r,
    then gather each r×r cell channel-major (index c·r·r + i·r + j, the order of ``F.unfold``)."""
    c = features.shape[-1]
    grid = features.view(grid_h, grid_w, c)
    grid = F.pad(grid, (0, 0, 0, -grid_w % ratio, 0, -grid_h % ratio))
    tok_h, tok_w = grid.shape[0] // ratio, grid.shape[1] // ratio
    cells = grid.view(tok_h, ratio, tok_w, ratio, c).permute(0, 2, 4, 1, 3)  # [th, tw, C, r, r]
    return cells.reshape(tok_h * tok_w, c * ratio * ratio)


class DeepseekV41Aligner(nn.Module):
    """Maps ViT features to LM tokens: 3×3 patch cells (pixel-unshuffle) → Linear → GELU → Linear."""

    def __init__(self, config, text_hidden_size: int):
        super().__init__()
        self.downsample_ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * config.downsample_ratio**2, text_hidden_size)
        self.w2 = nn.Linear(text_hidden_size, text_hidden_size)

    def forward(self, image_features: Sequence[torch.Tensor], image_grid_hw: torch.Tensor) -> list[torch.Tensor]:
        """image_features: the ViT output, one [h·w, C] per image; image_grid_hw: [n_images, 2] ViT grids.
        Returns one [h_tok·w_tok, text_hidden_size] per image, tokens in reading order."""
        grids = [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
        if len(grids) != len(image_features):
            raise ValueError(f"got {len(image_features)} feature tensors for {len(grids)} image grids")
        out = []
        for features, (h, w) in zip(image_features, grids):
            if features.ndim != 2 or features.shape[0] != h * w:
                raise ValueError(f"features of shape {tuple(features.shape)} do not fit a {h}×{w} patch grid")
            cells = unfold_token_grid(features, h, w, self.downsample_ratio)
            out.append(self.w2(F.gelu(self.w1(cells))))
        return out


def encode_images(
    vision: DeepseekV41VisionTransformer,
    aligner: DeepseekV41Aligner,
    pixel_values: torch.Tensor,
    image_grid_hw: torch.Tensor,
    output_hidden_states: bool,
    output_attentions: bool,
) -> BaseModelOutputWithPooling:
    """The images through DeepSeek-ViT, then the aligner: what ``DeepseekV41Model.get_image_features`` returns."""
    images = vision.encode(pixel_values, image_grid_hw, output_hidden_states, output_attentions)
    features = [image[0] for image in images]
    hidden_states = attentions = None
    if output_hidden_states:
        hidden_states = tuple(torch.cat(layer) for layer in zip(*(image[1] for image in images)))
    if output_attentions:
        attentions = tuple(zip(*(image[2] for image in images)))
    return BaseModelOutputWithPooling(
        last_hidden_state=torch.cat(features),
        pooler_output=aligner(features, image_grid_hw),
        hidden_states=hidden_states,
        attentions=attentions,
    )


def image_token_grids(image_grid_hw: torch.Tensor, config) -> list[tuple[int, int]]:
    """Each image's grid of LM tokens (from its patch grid, ``config`` the vision config); an image whose span
    would exceed ``max_image_tokens`` is refused."""
    grids = [token_grid(g, config.downsample_ratio) for g in image_grid_hw.tolist()]
    for index, grid in enumerate(grids):
        if span_length(grid) > config.max_image_tokens:
            raise ValueError(
                f"image {index} needs {span_length(grid)} positions, more than max_image_tokens "
                f"({config.max_image_tokens}); preprocess it with the DeepseekV41ImageProcessor"
            )
    return grids


def image_positions(image_token_types: torch.Tensor | None) -> torch.Tensor | None:
    """Where the image spans sit [B, S] bool (every token that is not text), or None without token types: the
    routers take ``bias_vl`` there and Engram adds nothing."""
    return None if image_token_types is None else image_token_types != TEXT


def _image_spans(image_token_types: torch.Tensor) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every image span, end inclusive, row-major over the batch. Raises
    unless the types are -1..3 and every row is text with well-formed start…end spans."""
    if image_token_types.ndim != 2:
        raise ValueError(f"image_token_types must be [batch, seq], got shape {tuple(image_token_types.shape)}")
    types = image_token_types
    if ((types < TEXT) | (types > END)).any():
        raise ValueError("image_token_types must hold -1 (text), 0 (start), 1 (image), 2 (newline) or 3 (end)")
    is_start, is_end = types == START, types == END
    # 1 from a start through its end, 0 elsewhere, when spans are well formed
    depth = is_start.long().cumsum(1) - is_end.long().cumsum(1) + is_end.long()
    well_formed = ((depth == 1) == (types != TEXT)).all() and (depth[:, -1] - is_end[:, -1].long() == 0).all()
    if not well_formed or ((depth != 0) & (depth != 1)).any():
        raise ValueError(
            "image_token_types has a malformed image span: each span must be one start (0), then image (1) "
            "and newline (2) tokens, then one end (3), with only text (-1) outside spans"
        )
    starts, ends = is_start.nonzero().tolist(), is_end.nonzero().tolist()
    return [(b, s, e) for (b, s), (_, e) in zip(starts, ends)]


def _span_grid(inner: torch.Tensor) -> tuple[int, int]:
    """(rows, width) of a span's inner types, which must be rows × (width image tokens + newline)."""
    rows = int((inner == NEWLINE).sum())
    if rows == 0 or inner.numel() % rows or inner.numel() // rows < 2:
        raise ValueError(f"image span of {inner.numel()} inner tokens does not split into rows ending in a newline")
    lines = inner.reshape(rows, -1)
    if not ((lines[:, -1] == NEWLINE).all() and (lines[:, :-1] == IMAGE).all()):
        raise ValueError("image span rows must each be the same number of image tokens followed by one newline")
    return rows, lines.shape[1] - 1


def merge_image_embeddings(
    inputs_embeds: torch.Tensor,
    image_token_types: torch.Tensor,
    image_features: Sequence[torch.Tensor],
    image_start: torch.Tensor,
    image_newline: torch.Tensor,
    image_end: torch.Tensor,
    token_grids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Write images into the LM input: delimiter slots take the learned vectors, image slots take the
    aligner rows in reading order. Everything is cast to ``inputs_embeds.dtype``, as the reference does.

    inputs_embeds: [B, S, D]; image_token_types: [B, S] (-1 text, 0 start, 1 image, 2 newline, 3 end);
    image_features: one [h·w, D] per image span, in order of appearance (row-major over the batch);
    token_grids: optional (h, w) per image; when given each span must have exactly h rows of w tokens.
    Returns a new [B, S, D] tensor, differentiable in all tensor inputs (``inputs_embeds`` itself when
    there are no image spans).
    """
    if image_token_types.shape != inputs_embeds.shape[:-1]:
        raise ValueError(
            f"image_token_types {tuple(image_token_types.shape)} must match inputs_embeds "
            f"{tuple(inputs_embeds.shape)} without its last dimension"
        )
    spans = _image_spans(image_token_types)
    if len(spans) != len(image_features):
        raise ValueError(f"found {count(len(spans), 'image span')} but got {count(len(image_features), 'image')}")
    if token_grids is not None and len(token_grids) != len(image_features):
        raise ValueError(f"got {count(len(token_grids), 'token grid')} for {count(len(image_features), 'image')}")
    if not spans:
        return inputs_embeds
    dim = inputs_embeds.shape[-1]
    for i, ((b, s, e), features) in enumerate(zip(spans, image_features)):
        rows, width = _span_grid(image_token_types[b, s + 1 : e])
        if token_grids is not None and tuple(int(n) for n in token_grids[i]) != (rows, width):
            raise ValueError(
                f"image {i}: its span (batch {b}, position {s}) is a {rows}×{width} grid, "
                f"but its token grid is {tuple(token_grids[i])}"
            )
        if features.shape != (rows * width, dim):
            raise ValueError(
                f"image {i}: its span (batch {b}, position {s}) has {rows}×{width} image tokens of width {dim}, "
                f"but its features have shape {tuple(features.shape)}"
            )
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    types = image_token_types.to(device)
    merged = inputs_embeds.clone()
    merged[types == START] = image_start.to(device, dtype)
    merged[types == NEWLINE] = image_newline.to(device, dtype)
    merged[types == END] = image_end.to(device, dtype)
    merged[types == IMAGE] = torch.cat([f.to(device, dtype) for f in image_features])
    return merged
