"""CSA2 attention of DeepSeek-V4.1: a sliding window of raw K=V plus, on compressed layers, a sparse
selection of compressed KV.

Per layer ``i`` with ``compress_ratios[i] = r`` (its roles: ``config.layer_plan[i]``, a
:class:`~configuration.LayerSpec`):

* every layer attends over the last ``sliding_window`` tokens' shared K=V vector (``wkv`` → ``kv_norm``);
* a **KV source** (``kv_source_layer_ids``) pools each group of ``r`` tokens into one latent
  (:class:`DeepseekV41Compressor`); later layers with the same ratio reuse the latest source's latents;
* an **index source** (``index_source_layer_ids``) runs an :class:`DeepseekV41Indexer` that keeps the
  ``index_topk`` best compressed positions per query; the layers in between reuse its selection. The
  **candidate source** first keeps ``candidate_topk_blocks`` blocks, and later indexers score only inside
  them;
* queries come from the low-rank ``wq_a`` → ``q_norm`` → ``wq_b``; every head shares the one K=V vector;
  a per-head ``attn_sink`` joins the softmax denominator; the output's rope slice is rotated back and
  projected by the block-diagonal ``wo_a`` (``o_groups``) and ``wo_b``.

Each query attends over a list of *slots* (rows of the concatenated [window K=V; compressed K=V], -1 for none)
laid out as the reference lays them out: its window positions oldest first, then its selected compressed rows in
position order, for :func:`~.sparse_attention.sink_attention` (the reference kernel's rounding). A full pass runs
the indexer and the attention
over ``query_chunk_size`` queries at a time, by the same per-query ops, so that its memory grows linearly with the
sequence length.

What a source hands to its consumers within one forward lives in :class:`CompressedContext`; what decoding
carries from one forward to the next lives in :class:`~.layer_cache.DeepseekV41LayerCache`. A full pass and a decode
step run the same steps; the cache enters where a decode step joins the cached window keys and continues the cached
compressed rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layer_cache import CacheStep, DeepseekV41LayerCache, gather_rows
from .linear import DeepseekV41Fp32Linear, DeepseekV41GroupedLinear, einsum_rounded_once
from .norms import DeepseekV41RMSNorm
from .codec import fp4_qdq_e4m3_scale, fp4_qdq_e8m0_scale, fp8_qdq, straight_through
from .rotary import apply_rotary
from .sparse_attention import attention_from_probs, sink_attention, sink_attention_probs

_fp8_qdq = straight_through(fp8_qdq)
_fp4_qdq_kv = straight_through(fp4_qdq_e4m3_scale)
_fp4_qdq_index = straight_through(fp4_qdq_e8m0_scale)


@dataclass
class CompressedContext:
    """State that compressed layers hand down the stack during one forward pass.

    compress_kv [B, T, D]: latest KV source's compressed K=V (rotated, quantized as cached).
    index_k [B, T, Di]: latest key owner's index keys. selection [B, S, k] long: latest index source's top-k
    compressed rows per query, ascending, -1 for none (see :func:`topk_selection`). candidates [B, S, n] long:
    the candidate source's blocks per query, -1 for none (see :func:`candidate_blocks`), kept as block ids
    rather than a [B, S, T] mask so that the state stays linear in the sequence length. index_scores [B, C, T]:
    the last index source's masked scores for its last query chunk (every query when S fits one chunk), kept
    for inspection.
    """

    compress_kv: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    index_scores: torch.Tensor | None = None


class DeepseekV41Compressor(nn.Module):
    """Pools ``r`` consecutive tokens into one latent: softmax(``wgate``)-weighted ``wkv`` for r > 1 (in fp32,
    as trained), a plain ``wkv`` projection for r = 1; then ``norm``. Returns latents before RoPE [B, S//r, D]:
    the indexer needs them unrotated. A trailing incomplete group yields nothing."""

    def __init__(self, config, ratio: int):
        super().__init__()
        self.ratio = ratio
        if ratio > 1:  # created fp32 whatever the default dtype, as from_pretrained keeps them (reference dtypes)
            self.wkv = DeepseekV41Fp32Linear(config.hidden_size, config.head_dim, bias=False, dtype=torch.float32)
            self.wgate = DeepseekV41Fp32Linear(config.hidden_size, config.head_dim, bias=False, dtype=torch.float32)
        else:
            self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
            self.wgate = None
        self.norm = DeepseekV41RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgate is None:
            return self.norm(self.wkv(x))
        r = self.ratio
        usable = x.shape[1] - x.shape[1] % r
        kv, score = self.project(x[:, :usable])
        return self.pool(kv.unflatten(1, (-1, r)), score.unflatten(1, (-1, r)), x.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``wkv`` and ``wgate`` projections of every token [B, S, D] (r > 1): what a decode cache holds for
        a group that is still filling up."""
        return self.wkv(x), self.wgate(x)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Complete groups kv, score [B, G, r, D] (fp32) → normalized latents [B, G, D] in ``dtype``."""
        return self.norm((kv * score.softmax(dim=2)).sum(dim=2).to(dtype))


def candidate_blocks(
    scores: torch.Tensor, compress_lens: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Level one of the two-level top-k. scores [..., T] with unreachable positions at -inf; returns the ids
    [..., min(topk_blocks, ⌈T / block_size⌉)] of each query's best blocks (a block scores its best position),
    -1 where a pick has no reachable position. The block holding the query's newest reachable position is always
    kept: it is only partly filled and could otherwise lose to an older full block."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    blocks = blocks.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = blocks.shape[-1]
    newest = ((compress_lens - 1) // block_size).unsqueeze(-1)
    blocks = blocks.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, torch.inf)
    top = blocks.topk(min(topk_blocks, n_blocks), dim=-1)
    return top.indices.masked_fill(top.values == -torch.inf, -1)


def candidate_mask(blocks: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """bool [..., width]: the compressed positions inside ``blocks`` [..., n] (block ids, -1 for none)."""
    n_blocks = -(-width // block_size)
    keep = blocks.new_zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool)  # the last column takes the -1s
    keep.scatter_(-1, torch.where(blocks >= 0, blocks, n_blocks), True)
    return keep[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :width]


class DeepseekV41Indexer(nn.Module):
    """Scores compressed positions for each query with a small multi-head side attention (FP4 q and k in the
    reference), ReLU'd and mixed by ``weights_proj``, and keeps the top ``index_topk``. Key owners (KV sources)
    derive index keys from their compressor's latents with ``wk`` → ``k_norm``.

    Selection is discrete: no gradient flows through it, so its weights are frozen by default in training.
    """

    def __init__(self, config, layer_id: int, owns_keys: bool):
        super().__init__()
        spec = config.layer_spec(layer_id)
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.ratio = spec.compress_ratio
        self.is_candidate_source = spec.is_candidate_source
        self.uses_candidates = spec.candidate_source_id is not None
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.emulate_quantization = config.emulate_quantization
        self.query_chunk_size = config.query_chunk_size
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False) if owns_keys else None
        self.k_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps) if owns_keys else None

    @torch.no_grad()
    def index_keys(self, latent: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Index keys [B, T, Di] from unrotated latents [B, T, D]; rotation: [B, T, R] at each group's first token.

        Outside autograd like the selection they feed: a compiled graph would otherwise return them as an output
        that requires grad and hand ``wk`` and ``k_norm`` zero gradients that eager never makes."""
        k = apply_rotary(self.k_norm(self.wk(latent)), rotation)
        return _fp4_qdq_index(k) if self.emulate_quantization else k

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        rotation: torch.Tensor,
        ctx: CompressedContext,
        compress_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x [B,S,D], qr [B,S,q_lora], compress_lens [S] or [B, S] (compressed rows each query may see);
        returns the selection [B, S, k]: ascending compressed rows, -1 for none (see :func:`topk_selection`).

        Scores and top-k run over ``query_chunk_size`` queries at a time, so that the [B, S, heads, T] scores
        never exist whole: each query's row is computed by the same ops whatever the chunking.
        """
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rotary(q, rotation)
        if self.emulate_quantization:
            q = _fp4_qdq_index(q)
        weights = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        chunk = self.query_chunk_size
        candidates = (
            ctx.candidates.split(chunk, dim=1) if self.uses_candidates and ctx.candidates is not None else None
        )
        selections, blocks = [], []
        for i, (q_chunk, w_chunk, lens) in enumerate(
            zip(q.split(chunk, dim=1), weights.split(chunk, dim=1), compress_lens.split(chunk, dim=-1))
        ):
            scores = self.score(q_chunk, w_chunk, ctx.index_k, lens)
            if self.is_candidate_source:
                blocks.append(
                    candidate_blocks(
                        scores, lens.expand(scores.shape[:2]), self.candidate_topk_blocks, self.candidate_block_size
                    )
                )
            elif candidates is not None:
                allowed = candidate_mask(candidates[i], scores.shape[-1], self.candidate_block_size)
                scores = scores.masked_fill(~allowed, -torch.inf)
            selections.append(topk_selection(scores, lens, self.topk))
        if self.is_candidate_source:
            ctx.candidates = torch.cat(blocks, dim=1)
        ctx.index_scores = scores
        return torch.cat(selections, dim=1)

    def score(
        self, q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, compress_lens: torch.Tensor
    ) -> torch.Tensor:
        """Index scores [B, C, T] of queries q [B, C, heads, Di] (head weights [B, C, heads]) against the index
        keys [B, T, Di], -inf past each query's compressed length (compress_lens [C] or [B, C])."""
        scores = einsum_rounded_once("bshd,btd->bsht", q, index_k)
        scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)  # [B, C, T], in the activation dtype
        reachable = torch.arange(scores.shape[-1], device=q.device) < compress_lens.unsqueeze(-1)
        return scores.masked_fill(~reachable, -torch.inf)


def topk_selection(scores: torch.Tensor, compress_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best compressed rows per query [B, S, min(topk, T)] from scores [B, S, T], in ascending row
    order, -1 for a pick at or past the query's compressed length (``compress_lens`` [S] or [B, S]). A reachable
    row may be picked at -inf (too few candidates): the reference attends to it, and so do we."""
    k = min(topk, scores.shape[-1])
    picked = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return picked.masked_fill(picked >= compress_lens.unsqueeze(-1), -1)


def _decoding(step: CacheStep | None) -> bool:
    """Whether a call adds tokens to a cached sequence (else it is a full pass: without a cache, or the prefill)."""
    return step is not None and not step.prefill


def prefill_window_slots(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[S, min(S, W)]: query i reads positions max(0, i - W + 1) onwards, oldest first, -1 past i."""
    query = torch.arange(seq_len, device=device).unsqueeze(1)
    slots = (query - window + 1).clamp_min(0) + torch.arange(min(seq_len, window), device=device)
    return slots.masked_fill(slots > query, -1)


def _shifted(selection: torch.Tensor, offset: int) -> torch.Tensor:
    """Compressed-row picks as slots of the concatenated [window; compressed] K=V."""
    return (selection + offset).masked_fill(selection < 0, -1)


def _joined(chunks: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The query chunks' results along ``dim``; a single chunk as it is (a concatenation would copy it)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)


class DeepseekV41Attention(nn.Module):
    """One CSA2 attention layer (see the module docstring). Names follow the released checkpoint."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.n_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.window = config.sliding_window
        spec = config.layer_spec(layer_id)  # window-only for the DSpark draft blocks (ids past the backbone's)
        self.ratio = spec.compress_ratio
        self.is_kv_source, self.is_index_source = spec.is_kv_source, spec.is_index_source
        self.emulate_quantization = config.emulate_quantization
        self.query_chunk_size = config.query_chunk_size
        self.scale = self.head_dim**-0.5

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = DeepseekV41RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)
        # block-diagonal: group g projects only its own heads' outputs
        self.wo_a = DeepseekV41GroupedLinear(
            self.n_heads * self.head_dim // self.n_groups, self.o_lora_rank, self.n_groups
        )
        self.wo_b = nn.Linear(self.n_groups * self.o_lora_rank, config.hidden_size, bias=False)
        self.compressor = DeepseekV41Compressor(config, self.ratio) if self.is_kv_source else None
        self.indexer = DeepseekV41Indexer(config, layer_id, self.is_kv_source) if self.is_index_source else None

    def forward(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        ctx: CompressedContext,
        layer_cache: DeepseekV41LayerCache | None = None,
        step: CacheStep | None = None,
        output_attentions: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B,S,D] (positions 0..S-1), rotation [S, R] complex for this layer's rope kind → [B,S,D].

        ``output_attentions`` also returns DeepSeek-V4.1's attention map, ``(out, (probs, slot_index))``, and computes
        ``out`` from it (:func:`attention_from_probs`: the same to rounding, with the map on the gradient path): a
        query attends over its own list of slots rather than over all keys, so the map is probs [B, H, S, K], each
        head's softmax probability on each slot (the sink takes the rest of the row), with slot_index [B, S, K]
        saying what each slot is: its first ``min(S, sliding_window)`` slots (``sliding_window`` when decoding)
        are key positions of the window, oldest first; on compressed layers the rest are the selected compressed
        rows, ascending (row t pools positions t·r … t·r + r - 1 for ``r = compress_ratios[layer]``); -1 is empty.

        Padding needs no mask: the model aligns every row to start at 0, so padding only follows a row's real
        tokens, outside their windows and compressed lengths.

        With a ``layer_cache``, the prefill ``step`` also records the decode state; on later steps x holds only the
        new tokens (at ``step.positions``, rotation [B, S, R]), which the same steps join to the cached state where
        it enters: the window keys (:meth:`_window`) and the compressed rows (:meth:`_pool`, :meth:`_compress`).
        """
        rot = rotation.expand(x.shape[0], *rotation.shape[-2:])  # [B, S, R]: a full pass's table is every row's
        qr = self.q_norm(self.wq_a(x))
        q = apply_rotary(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), rot)
        kv, slots = window_kv, window_slots = self._window(x, rot, layer_cache, step)
        selection = None
        if self.ratio:
            compress_kv, selection = self._compressed(x, qr, rot, ctx, layer_cache, step)
            kv = torch.cat([window_kv, compress_kv], dim=1)
            slots = torch.cat([window_slots, _shifted(selection, window_kv.shape[1])], dim=-1)
        if not output_attentions:
            return self._attend(q, kv, slots, rot)
        probs = self._per_query_chunk(sink_attention_probs, q, kv, slots, dim=2)
        slot_index = self._slot_index(window_slots, selection, layer_cache, step)
        return self._output(attention_from_probs(probs, kv, slots), rot), (probs, slot_index)

    def _window_kv(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Each token's shared K=V [B,S,D], rotated (and FP8 quantize-dequantized, as cached by the reference)."""
        kv = apply_rotary(self.kv_norm(self.wkv(x)), rot)
        return _fp8_qdq(kv) if self.emulate_quantization else kv

    def _window(
        self, x: torch.Tensor, rot: torch.Tensor, layer_cache: DeepseekV41LayerCache | None, step: CacheStep | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window K=V rows this call attends over [B, N, D] and each query's slots in them [B, S, W']: in a full
        pass the call's own tokens (the prefill keeps each row's last W); when decoding, the call's tokens after
        the cached window (N = W + S)."""
        kv = self._window_kv(x, rot)
        if _decoding(step):
            return layer_cache.extend_window(kv), step.window_slots
        if layer_cache is not None:
            layer_cache.store_window(kv, step.lengths)
        return kv, prefill_window_slots(x.shape[1], self.window, x.device).expand(x.shape[0], -1, -1)

    def _slot_index(
        self,
        window_slots: torch.Tensor,
        selection: torch.Tensor | None,
        layer_cache: DeepseekV41LayerCache | None,
        step: CacheStep | None,
    ) -> torch.Tensor:
        """What each slot of the attention map is [B, S, K]: window key positions, then compressed rows (-1 none).
        A decode step's window slots index the cached window, which starts at position ``past - W``."""
        positions = window_slots
        if _decoding(step):
            positions = torch.where(window_slots >= 0, window_slots + (step.past - self.window).view(-1, 1, 1), -1)
        return positions if selection is None else torch.cat([positions, selection], dim=-1)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Sink attention of q [B, S, H, D] over the rows of kv [B, N, D] that ``slots`` [B, S, K] pick, then the
        output projections."""
        return self._output(self._per_query_chunk(sink_attention, q, kv, slots, dim=1), rot)

    def _per_query_chunk(
        self, attention: Callable, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, dim: int
    ) -> torch.Tensor:
        """``attention(q, kv, slots, sink, scale)`` over ``query_chunk_size`` queries at a time (each query's row by
        the same ops whatever the chunking), the chunks joined along ``dim``."""
        chunk = self.query_chunk_size
        return _joined(
            [
                attention(q_chunk, kv, slots_chunk, self.attn_sink, self.scale)
                for q_chunk, slots_chunk in zip(q.split(chunk, dim=1), slots.split(chunk, dim=1))
            ],
            dim=dim,
        )

    def _output(self, out: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """The attention's output [B, S, H, D] → [B, S, hidden]: the rope slice rotated back, then ``wo_a``,
        ``wo_b``."""
        bsz, seq_len = out.shape[:2]
        out = apply_rotary(out, rot, inverse=True).view(bsz, seq_len, self.n_groups, -1)
        return self.wo_b(self.wo_a(out).flatten(2))

    def _compressed(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        rot: torch.Tensor,
        ctx: CompressedContext,
        layer_cache: DeepseekV41LayerCache | None,
        step: CacheStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed K=V this layer reads [B,T,D] and the rows each query attends to [B,S,k] (-1 = none): a KV
        source publishes its rows, an index source its selection, for the layers up to the next one."""
        if self.is_kv_source:
            self._compress(x, rot, ctx, layer_cache, step)
        if self.is_index_source:
            ctx.selection = self._select(x, qr, rot, ctx, step)
        return ctx.compress_kv, ctx.selection

    def _compress(
        self,
        x: torch.Tensor,
        rot: torch.Tensor,
        ctx: CompressedContext,
        layer_cache: DeepseekV41LayerCache | None,
        step: CacheStep | None,
    ) -> None:
        """A KV source's compressed K=V (and its index keys, where it owns them) into ``ctx``: the rows this call
        completes, rotated at their groups' first tokens; when decoding, every cached row, these appended."""
        r, decoding = self.ratio, _decoding(step)
        held = None if layer_cache is None else step.past // r  # [B] rows each row holds before this call
        latent, new_rows = self._pool(x, layer_cache, step)  # [B, G, D] unrotated; [B] of them real
        if decoding:  # a group's first token may belong to an earlier call
            group_rot = step.compress_rotary((held.unsqueeze(1) + torch.arange(latent.shape[1], device=x.device)) * r)
        else:
            group_rot = rot[:, : latent.shape[1] * r : r]
        index_k = self.indexer.index_keys(latent, group_rot) if self.indexer is not None else None
        latent = apply_rotary(latent, group_rot)
        latent = _fp4_qdq_kv(latent) if self.emulate_quantization else latent
        if layer_cache is not None:
            layer_cache.append_compressed(latent, index_k, held, new_rows, step.columns)
        if decoding:
            latent = layer_cache.compressed_kv
            index_k = None if index_k is None else layer_cache.index_keys
        ctx.compress_kv = latent
        if index_k is not None:
            ctx.index_k = index_k

    def _pool(
        self, x: torch.Tensor, layer_cache: DeepseekV41LayerCache | None, step: CacheStep | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The latents [B, G, D] (unrotated) of the groups this call completes, and with a cache how many of them
        each row completes for real [B]. A full pass pools x's complete groups (the prefill also keeps each row's
        open group); when decoding, the cache's open group continues with x (r > 1)."""
        r = self.ratio
        if layer_cache is None:
            return self.compressor(x), None
        if step.prefill:
            new_rows = step.lengths // r
            if r > 1:
                self._keep_open_group(x, layer_cache, new_rows, step.lengths)
            return self.compressor(x), new_rows
        if r == 1:
            return self.compressor(x), torch.full_like(step.past, x.shape[1])
        kv, score, complete = layer_cache.complete_groups(*self.compressor.project(x), step.past)
        return self.compressor.pool(kv, score, x.dtype), complete

    def _keep_open_group(
        self, x: torch.Tensor, layer_cache: DeepseekV41LayerCache, rows: torch.Tensor, lengths: torch.Tensor
    ) -> None:
        """After a full pass: the projections of each row's open group (the tokens after its ``rows`` complete
        groups), and while recording those of every token (what a rewind into the prompt rebuilds groups from)."""
        open_group = (rows * self.ratio).unsqueeze(1) + torch.arange(self.ratio, device=x.device)
        layer_cache.store_pending(*self.compressor.project(gather_rows(x, open_group)))
        if layer_cache.record_past:
            layer_cache.record_prefill_projections(*self.compressor.project(x), lengths)

    def _select(
        self, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor, ctx: CompressedContext, step: CacheStep | None
    ) -> torch.Tensor:
        """An index source's top-k selection [B, S, k] over the compressed rows each query sees: those before its
        own position's group."""
        if ctx.compress_kv.shape[1] == 0:
            return x.new_zeros(x.shape[0], x.shape[1], 0, dtype=torch.long)
        if _decoding(step):
            visible = (step.positions + 1) // self.ratio  # [B, S]
        else:
            visible = torch.arange(1, x.shape[1] + 1, device=x.device) // self.ratio  # [S]
        return self.indexer(x, qr, rot, ctx, visible)
