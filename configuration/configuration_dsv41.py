"""Configuration of DeepSeek-V4.1: a CSA2 / mHC / MoE / Engram text backbone and an optional DeepSeek-ViT.

Key names follow the released Hub ``config.json`` (nested, HF style). The flat reference
``inference/config.json`` (DeepSeek's ``ModelArgs`` keys such as ``dim`` and ``n_layers``) is accepted
too: :meth:`DeepseekV41Config.from_reference_dict` translates it, and ``from_pretrained`` on a folder
holding such a file gives the equivalent config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

_RELEASED_COMPRESS_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3


def _default_yarn() -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    }


def _one_of(value: Any, alias: Any) -> Any:
    """``value`` or, when it is unset, ``alias`` (the same setting under another config's name). The attribute's own
    name wins: ``{**config.to_dict(), "compress_rope_scaling": ...}`` overrides the ``rope_scaling`` it serialized."""
    return alias if value is None else value


def _require_positive_int(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if type(value) is not int or value <= 0:
            raise ValueError(f"{owner} {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LayerSpec:
    """What backbone layer ``layer_id`` is, derived from the config's five schedule fields (see
    :attr:`DeepseekV41TextConfig.layer_plan`). A layer that does not compress (ratio 0) attends over its sliding
    window only, and its source ids are ``None``.

    Attributes:
        compress_ratio: ``compress_ratios[layer_id]``: tokens pooled per compressed K=V row, 0 for window only.
        kv_source_id: the layer whose compressed K=V it attends over (the latest KV source up to it; itself for a KV
            source, which owns the compressor).
        index_source_id: the layer whose top-k selection it reads (the latest index source up to it; itself for an
            index source, which runs an indexer).
        candidate_source_id: for an indexer after the candidate source, that layer: it scores only inside the
            candidate blocks that layer kept.
        is_candidate_source: whether its indexer keeps the candidate blocks later indexers score inside.
        engram_index: its position in ``engram_layer_ids`` (the hasher's column of its Engram read before the
            attention), ``None`` without Engram.
    """

    layer_id: int
    compress_ratio: int = 0
    kv_source_id: int | None = None
    index_source_id: int | None = None
    candidate_source_id: int | None = None
    is_candidate_source: bool = False
    engram_index: int | None = None

    @property
    def is_compressed(self) -> bool:
        return self.compress_ratio > 0

    @property
    def is_kv_source(self) -> bool:
        return self.kv_source_id == self.layer_id

    @property
    def is_index_source(self) -> bool:
        return self.index_source_id == self.layer_id

    @property
    def has_engram(self) -> bool:
        return self.engram_index is not None

    @property
    def kind(self) -> str:
        """A readable name: ``"window"`` or ``"compressed_{r}"``, after ``"engram+"`` and before its roles,
        e.g. ``"engram+compressed_2+kv_source+index_source"``."""
        roles = [
            name
            for name, has in (
                ("kv_source", self.is_kv_source),
                ("index_source", self.is_index_source),
                ("candidate_source", self.is_candidate_source),
            )
            if has
        ]
        attention = f"compressed_{self.compress_ratio}" if self.is_compressed else "window"
        return "+".join(["engram"] * self.has_engram + [attention] + roles)


@lru_cache(maxsize=64)
def _layer_plan(
    n: int,
    ratios: tuple[int, ...],
    kv_ids: tuple[int, ...],
    index_ids: tuple[int, ...],
    cand: int,
    engram_ids: tuple[int, ...],
) -> tuple[LayerSpec, ...]:
    """The specs of layers 0..n-1 from the schedule fields (as tuples, so that each combination is checked and built
    once); a ``ValueError`` names the first inconsistency."""
    if len(ratios) < n:
        raise ValueError(f"compress_ratios has {len(ratios)} entries but there are {n} layers (one per layer needed)")
    if any(type(r) is not int or r < 0 for r in ratios):
        raise ValueError(f"compress_ratios must be non-negative integers, got {list(ratios)}")
    for name, ids in (("kv_source_layer_ids", kv_ids), ("index_source_layer_ids", index_ids)):
        if list(ids) != sorted(set(ids)) or any(type(i) is not int or i < 0 for i in ids):
            raise ValueError(f"{name} must be strictly increasing non-negative layer ids, got {list(ids)}")
    kv_sources = [i for i in kv_ids if i < n]
    index_sources = [i for i in index_ids if i < n]
    for i in kv_sources + index_sources:
        if ratios[i] == 0:
            raise ValueError(f"layer {i} is a KV/index source but does not compress (compress_ratios[{i}] == 0)")
    if not set(kv_sources) <= set(index_sources):
        raise ValueError(
            f"every KV source must also be an index source (it owns the index keys): {kv_sources} vs {index_sources}"
        )
    owners: dict[int, tuple[int, int]] = {}  # compressed layer → (KV source, index source)
    for i in range(n):
        if ratios[i] == 0:
            continue
        kv_owner = max((s for s in kv_sources if s <= i), default=None)
        if kv_owner is None or ratios[kv_owner] != ratios[i]:
            raise ValueError(
                f"compressed layer {i} (ratio {ratios[i]}) needs a preceding KV source with the same ratio; "
                f"kv_source_layer_ids={list(kv_ids)}"
            )
        index_owner = max((s for s in index_sources if s <= i), default=None)
        if index_owner is None:
            raise ValueError(f"compressed layer {i} has no preceding index source")
        owners[i] = kv_owner, index_owner
    if type(cand) is not int or cand < -1:
        raise ValueError(f"candidate_source_layer_id must be -1 (off) or a layer id, got {cand!r}")
    if 0 <= cand < n and cand not in kv_sources:
        raise ValueError(f"candidate_source_layer_id {cand} must be a KV source layer ({kv_sources})")
    if list(engram_ids) != sorted(set(engram_ids)) or any(type(i) is not int or not 0 <= i < n for i in engram_ids):
        raise ValueError(f"engram_layer_ids must be increasing layer ids below {n}, got {list(engram_ids)}")
    plan = []
    for i in range(n):
        engram_index = engram_ids.index(i) if i in engram_ids else None
        if i not in owners:
            plan.append(LayerSpec(i, engram_index=engram_index))
            continue
        kv_owner, index_owner = owners[i]
        candidates = cand if index_owner == i and 0 <= cand < i else None  # an indexer after the candidate source
        plan.append(LayerSpec(i, ratios[i], kv_owner, index_owner, candidates, i == cand, engram_index))
    return tuple(plan)


@strict
class DeepseekV41TextConfig(PreTrainedConfig):
    r"""The DeepSeek-V4.1 language backbone.

    Defaults are the released DeepSeek-V4.1-Flash sizes (docs/design.md §2). Attention layer ``i`` attends over a
    sliding window of ``sliding_window`` raw tokens, and when ``compress_ratios[i] > 0`` also over KV
    compressed ``compress_ratios[i]``-to-1, produced by the latest preceding layer of
    ``kv_source_layer_ids`` and filtered by the latest indexer of ``index_source_layer_ids``.

    Args:
        compress_rope_scaling (`dict`): YaRN settings for the layers with compressed KV (window-only layers
            use plain RoPE with ``rope_theta``). Keys: ``factor``, ``beta_fast``, ``beta_slow``,
            ``original_max_position_embeddings``; ``rope_type`` ``"yarn"`` or ``"default"``.
        gate_temp (`float`): temperature dividing the router logits before the score function.
        emulate_quantization (`bool`): reproduce the reference's FP8 window-KV, FP4 compressed-KV and FP4
            indexer q/k quantize-dequantize steps bit-for-bit (straight-through gradients in training).
            ``False`` skips them.
        query_chunk_size (`int`): queries per chunk of a full (prefill or training) pass: the indexer's scores
            and top-k and the sparse attention run on this many queries at a time, so that peak memory grows
            linearly with the sequence length instead of holding [S, index heads, S / ratio] scores. Each query is
            computed by the same ops whatever the chunk size; lower it for very long contexts (the scores of one
            chunk take ``4 · batch · query_chunk_size · index_n_heads · S / ratio`` bytes).
        engram_table_dtype (`str`): ``"float"`` keeps Engram tables in the model dtype; ``"fp8"`` keeps them
            as stored in the released checkpoint (e4m3 + per-32 scales), dequantized on lookup.
        dspark_block_size (`int`): tokens the DSpark draft head (``mtp.*``: ``num_nextn_predict_layers`` blocks
            after the backbone) drafts per pass; 0 (the default) builds no draft head. The released model: 5.
        dspark_noise_token_id (`int`): the id filling the draft block after its first token.
        dspark_target_layer_ids (`list[int]`): backbone layers whose input streams (mean over the ``hc_mult``
            copies, taken in layer order) the draft head reads.
        dspark_markov_rank (`int`): rank of the draft head's Markov bias (previous token → logits).
        dspark_n_routed_experts / dspark_num_experts_per_tok (`int`): the draft blocks' MoE sizes (the released
            config's names; DeepSeek's ``inference/config.json`` says ``dspark_n_activated_experts`` for the top-k,
            accepted too); 0 takes the backbone's ``n_routed_experts`` / ``num_experts_per_tok``.
        topk_method (`str`): the routing, as the released config names it: ``"noaux_tc"`` (top-k of the scores
            plus the balancing biases, no auxiliary loss), the only one DeepSeek-V4.1 has.

    The compressed layers' YaRN settings are ``compress_rope_scaling`` here and ``rope_scaling`` in a config.json, as
    the released one names them (both names are read; given both, the attribute's own name wins).
    """

    model_type = "deepseek_v41_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    # Parallel plans of the backbone (keys relative to `DeepseekV41Model`), as transformers' deepseek_v4 has them,
    # plus the shared expert. The routed experts are ~95% of the weights. Sharded: `gate_up_proj` [E, 2I, D] on its
    # packed gate|up rows (each rank keeps the same I/tp slice of both), `down_proj` [E, D, I] on I, and the
    # experts' partial sums are all-reduced (`moe_tp_experts`); the shared expert on I too (`w1`/`w3` colwise, `w2`
    # rowwise, all-reduced): in the released storage these are FP8 Linears with 32x32-block scales, so each rank
    # loads I/tp rows (columns) of the FP8 bytes and the matching I/(32·tp) scale blocks; the vocabulary of `embed`
    # and of `lm_head`. The released storage needs I/tp to be a multiple of 32 (whole scale blocks per rank, checked
    # on load). Replicated, and why: attention is MQA with one shared K=V head broadcast to every query head, so
    # splitting the heads of the low-rank `wq_b` would also need the per-head `attn_sink`, the grouped `wo_a` (heads
    # are grouped by `o_groups`) and `wo_b` split consistently, for ~2% of the weights; the compressors, the
    # indexer, mHC (`hc_*`: tiny fp32 mixing matrices of the residual copies), the router and its biases and the
    # Engram tables (looked up by hashed n-gram id, not by a matmul) are small or not matmul-shaped.
    base_model_tp_plan = {
        "embed": "embedding_rowwise",
        "layers.*.ffn.experts.gate_up_proj": "packed_colwise",
        "layers.*.ffn.experts.down_proj": "rowwise",
        "layers.*.ffn.experts": "moe_tp_experts",
        "layers.*.ffn.shared_experts.w1": "colwise",
        "layers.*.ffn.shared_experts.w3": "colwise",
        "layers.*.ffn.shared_experts.w2": "rowwise",
    }
    # (The pipeline plan is the model's own: what crosses a stage boundary is its residual stream, see
    # `modeling_dsv41.residual_stream`.)
    # Expert parallelism: whole experts per rank (dim 0 of both fused tensors), tokens routed to them by the
    # `EPImplementation` that `DistributedConfig.ep_implementation` names.
    base_model_ep_plan = {
        "layers.*.ffn.experts.gate_up_proj": "grouped_gemm",
        "layers.*.ffn.experts.down_proj": "grouped_gemm",
        "layers.*.ffn.experts": "ep_dispatch_experts",
    }

    # the standard MoE name, read by transformers' FP8 experts (native released weights) and its TP/EP integrations
    attribute_map = {"num_local_experts": "n_routed_experts"}

    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    initializer_range: float = 0.02
    use_cache: bool = True
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list[int] | None = None
    kv_source_layer_ids: list[int] | None = None
    index_source_layer_ids: list[int] | None = None
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    query_chunk_size: int = 2048
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list[int] | None = None
    engram_num_embeddings: list[int] | None = None
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    engram_table_dtype: str = "float"
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    emulate_quantization: bool = True
    pad_token_id: int | None = 2
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        # the released config.json names the compressed layers' YaRN dict `rope_scaling`
        self.compress_rope_scaling = _one_of(self.compress_rope_scaling, kwargs.pop("rope_scaling", None))
        if self.compress_rope_scaling is None:
            self.compress_rope_scaling = _default_yarn()
        self.compress_rope_scaling = dict(self.compress_rope_scaling)
        # DeepSeek's inference/config.json names the draft head's top-k `dspark_n_activated_experts`
        self.dspark_num_experts_per_tok = (
            _one_of(self.dspark_num_experts_per_tok or None, kwargs.pop("dspark_n_activated_experts", None)) or 0
        )
        if self.compress_ratios is None:
            self.compress_ratios = list(_RELEASED_COMPRESS_RATIOS)
        if self.kv_source_layer_ids is None:
            self.kv_source_layer_ids = [2, 8, 14, 20]
        if self.index_source_layer_ids is None:
            self.index_source_layer_ids = [2, 8, 14, 20, 24, 28, 32, 36]
        if self.engram_layer_ids is None:
            self.engram_layer_ids = [1, 14]
        if self.engram_num_embeddings is None:
            self.engram_num_embeddings = [384006168, 384016682] if self.engram_layer_ids == [1, 14] else []
        if self.dspark_target_layer_ids is None:
            self.dspark_target_layer_ids = []
        for name in (
            "compress_ratios",
            "kv_source_layer_ids",
            "index_source_layer_ids",
            "engram_layer_ids",
            "engram_num_embeddings",
            "dspark_target_layer_ids",
        ):
            setattr(
                self,
                name,
                [
                    int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    for v in getattr(self, name)
                ],
            )
        super().__post_init__(**kwargs)
        self._validate_dimensions()
        self._validate_schedule()
        self._validate_engram()
        self._validate_dspark()

    # ---- validation -------------------------------------------------------------------------------
    def _validate_dimensions(self) -> None:
        _require_positive_int(
            "text",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            q_lora_rank=self.q_lora_rank,
            o_lora_rank=self.o_lora_rank,
            o_groups=self.o_groups,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            sliding_window=self.sliding_window,
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            query_chunk_size=self.query_chunk_size,
            hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters,
        )
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4.1 shares one K=V vector per token: num_key_value_heads must be 1")
        if self.n_shared_experts != 1:
            raise ValueError("DeepSeek-V4.1 has exactly one shared expert: n_shared_experts must be 1")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most head_dim ({self.head_dim}) "
                f"and index_head_dim ({self.index_head_dim})"
            )
        # the QDQ boundaries work on blocks: FP8 window KV per 32, FP4 compressed KV per 16, indexer per 32
        for name, value, block in (("head_dim", self.head_dim, 32), ("index_head_dim", self.index_head_dim, 32)):
            if value % block:
                raise ValueError(f"{name} ({value}) must be a multiple of {block} (quantization block size)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_method != "noaux_tc":
            raise ValueError(f"DeepSeek-V4.1 routes with topk_method 'noaux_tc', got {self.topk_method!r}")
        if self.scoring_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"scoring_func must be softmax, sigmoid or sqrtsoftplus, got {self.scoring_func!r}")
        for name in (
            "rms_norm_eps",
            "hc_eps",
            "rope_theta",
            "compress_rope_theta",
            "routed_scaling_factor",
            "gate_temp",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and positive, got {value!r}")
        yarn = self.compress_rope_scaling
        if yarn.get("rope_type", "yarn") not in ("yarn", "default"):
            raise ValueError(
                f"compress_rope_scaling rope_type must be 'yarn' or 'default', got {yarn.get('rope_type')!r}"
            )
        if yarn.get("rope_type", "yarn") == "yarn":
            missing = {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings"} - set(yarn)
            if missing:
                raise ValueError(f"compress_rope_scaling is missing YaRN keys {sorted(missing)}")

    def _validate_schedule(self) -> None:
        plan = self.layer_plan  # checks the schedule fields
        if any(spec.is_candidate_source for spec in plan):
            _require_positive_int(
                "text",
                candidate_topk_blocks=self.candidate_topk_blocks,
                candidate_block_size=self.candidate_block_size,
            )
            if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
                raise ValueError(
                    f"candidate_topk_blocks × candidate_block_size ({self.candidate_topk_blocks} × "
                    f"{self.candidate_block_size}) cannot fill index_topk ({self.index_topk})"
                )

    def _validate_engram(self) -> None:
        ids = self.engram_layer_ids  # checked by the layer plan
        if len(ids) != len(self.engram_num_embeddings):
            raise ValueError(
                f"engram_num_embeddings needs one table size per Engram layer: {self.engram_num_embeddings} vs {ids}"
            )
        if self.engram_table_dtype not in ("float", "fp8"):
            raise ValueError(f"engram_table_dtype must be 'float' or 'fp8', got {self.engram_table_dtype!r}")
        if not ids:
            return
        _require_positive_int(
            "text",
            engram_n_heads=self.engram_n_heads,
            engram_head_dim=self.engram_head_dim,
            engram_vocab_size=self.engram_vocab_size,
            engram_compressed_vocab_size=self.engram_compressed_vocab_size,
        )
        if any(type(rows) is not int or rows <= 0 for rows in self.engram_num_embeddings):
            raise ValueError(f"engram_num_embeddings must be positive integers, got {self.engram_num_embeddings}")
        if self.engram_max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be at least 2, got {self.engram_max_ngram_size}")
        if not 0 <= self.engram_pad_token_id < self.vocab_size:
            raise ValueError(f"engram_pad_token_id {self.engram_pad_token_id} is outside the vocabulary")

    def _validate_dspark(self) -> None:
        if self.dspark_block_size == 0:
            return
        _require_positive_int(
            "text",
            dspark_block_size=self.dspark_block_size,
            num_nextn_predict_layers=self.num_nextn_predict_layers,
            dspark_markov_rank=self.dspark_markov_rank,
        )
        ids = self.dspark_target_layer_ids
        if not ids or any(type(i) is not int or not 0 <= i < self.num_hidden_layers for i in ids):
            raise ValueError(
                f"dspark_target_layer_ids must name backbone layers below {self.num_hidden_layers}, got {ids}"
            )
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ValueError(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary")
        routed, active = self.dspark_n_routed_experts, self.dspark_num_experts_per_tok
        if any(type(v) is not int or v < 0 for v in (routed, active)):
            raise ValueError(
                f"dspark_n_routed_experts / dspark_num_experts_per_tok must be ≥ 0, got {routed}, {active}"
            )
        if self.dspark_top_k > self.dspark_num_routed_experts:
            raise ValueError(
                f"the DSpark MoE routes to {self.dspark_top_k} of {self.dspark_num_routed_experts} experts"
            )
        # the draft blocks attend over a window only (the reference asserts it); their compress_ratios entries are 0
        draft_ratios = self.compress_ratios[
            self.num_hidden_layers : self.num_hidden_layers + self.num_nextn_predict_layers
        ]
        if any(draft_ratios):
            raise ValueError(
                f"the DSpark draft blocks are window-only: their compress_ratios must be 0, got {draft_ratios}"
            )

    @property
    def layer_plan(self) -> tuple[LayerSpec, ...]:
        """One :class:`LayerSpec` per backbone layer, derived from ``compress_ratios``, ``kv_source_layer_ids``,
        ``index_source_layer_ids``, ``candidate_source_layer_id`` and ``engram_layer_ids`` (which stay the
        serialized form) and checked once per combination of them. Read on access, so it follows a field set later.
        """
        return _layer_plan(
            self.num_hidden_layers,
            tuple(self.compress_ratios),
            tuple(self.kv_source_layer_ids),
            tuple(self.index_source_layer_ids),
            self.candidate_source_layer_id,
            tuple(self.engram_layer_ids),
        )

    # Not `layer_types`: transformers reads that name (its config validation accepts only its own attention kinds,
    # and its caches and masks build sliding/full layers from it), which would change how it treats this model.
    @property
    def layer_kinds(self) -> list[str]:
        """The layer plan by name, one per backbone layer (:attr:`LayerSpec.kind`)."""
        return [spec.kind for spec in self.layer_plan]

    def layer_spec(self, layer_id: int) -> LayerSpec:
        """The plan's spec of a backbone layer; a window-only spec for the DSpark draft blocks' attention (ids
        ``num_hidden_layers + k``)."""
        return self.layer_plan[layer_id] if layer_id < self.num_hidden_layers else LayerSpec(layer_id)

    @property
    def has_dspark(self) -> bool:
        """Whether the model has the DSpark draft head (``mtp.*``)."""
        return self.dspark_block_size > 0

    @property
    def dspark_num_routed_experts(self) -> int:
        return self.dspark_n_routed_experts or self.n_routed_experts

    @property
    def dspark_top_k(self) -> int:
        """Experts each token of the draft head is routed to (``dspark_num_experts_per_tok``, or the backbone's)."""
        return self.dspark_num_experts_per_tok or self.num_experts_per_tok

    def to_dict(self) -> dict[str, Any]:
        """The released config.json's key names: the compressed layers' YaRN dict as ``rope_scaling``."""
        output = super().to_dict()
        output["rope_scaling"] = output.pop("compress_rope_scaling")
        return output


@strict
class DeepseekV41VisionConfig(PreTrainedConfig):
    r"""DeepSeek-ViT (2D-RoPE, linear patch embedding, RMSNorm, SwiGLU) and the image sizing rules.

    Args:
        max_image_tokens (`int`): bound on the positions one image occupies in the LM sequence
            (start + rows × (width + newline) + end), not on its visual tokens.
        min_pixels (`int`): images are upscaled to at least this many pixels first.
        max_wh_ratio (`float`, *optional*): aspect-ratio bound of the reference; ``None`` leaves it open.
    """

    model_type = "deepseek_v41_vision"
    base_config_key = "vision_config"

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    num_channels: int = 3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        _require_positive_int(
            "vision",
            num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            patch_size=self.patch_size,
            downsample_ratio=self.downsample_ratio,
            max_image_tokens=self.max_image_tokens,
            min_pixels=self.min_pixels,
        )
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                f"vision hidden_size ({self.hidden_size}) / num_attention_heads ({self.num_attention_heads}) must be "
                "an integer divisible by 4 (2D RoPE splits each head between rows and columns)"
            )
        if self.max_image_tokens < 5:
            raise ValueError(f"vision max_image_tokens ({self.max_image_tokens}) cannot hold even a 1×1 image span")
        if self.max_wh_ratio is not None and (not math.isfinite(self.max_wh_ratio) or self.max_wh_ratio < 1):
            raise ValueError(f"vision max_wh_ratio must be None or ≥ 1, got {self.max_wh_ratio!r}")


# the flat reference `inference/config.json` (ModelArgs) key → our text / vision config's key: read by
# `reference_to_config_dict`, and written back by the release exporter
REFERENCE_TEXT_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "swiglu_limit": "swiglu_limit",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "gate_temp": "gate_temp",
    "norm_topk_prob": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "compress_ratios": "compress_ratios",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "n_mtp_layers": "num_nextn_predict_layers",
    **{
        key: key
        for key in (
            "dspark_block_size",
            "dspark_noise_token_id",
            "dspark_target_layer_ids",
            "dspark_markov_rank",
            "dspark_n_routed_experts",
        )
    },
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
REFERENCE_VISION_KEYS = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}
# runtime knobs of the reference (cache sizes, sampling)
_REFERENCE_IGNORED_KEYS = {"max_batch_size", "max_seq_len", "temperature"}
_REFERENCE_MARKER_KEYS = {"dim", "n_layers", "n_heads"}


def released_quantization_dict(expert_dtype: str = "fp4") -> dict[str, Any]:
    """The root ``quantization_config`` of the released config.json: FP8 e4m3 weights with one E8M0 scale per 32x32
    block, the routed experts ``expert_dtype`` (``"fp4"``: packed E2M1 with a scale per 32 values)."""
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"the released experts are stored FP4 or FP8, got expert_dtype={expert_dtype!r}")
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": expert_dtype,
    }


def is_reference_config(config_dict: dict[str, Any]) -> bool:
    """True for the flat DeepSeek ``ModelArgs`` layout (``inference/config.json``)."""
    return _REFERENCE_MARKER_KEYS <= set(config_dict) and "text_config" not in config_dict


# keys a config.json must name: without them the defaults (the released 763B sizes) would silently build a model
# that matches no checkpoint but the released one
_REQUIRED_TEXT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_REQUIRED_REFERENCE_KEYS = (*sorted(_REFERENCE_MARKER_KEYS), "vocab_size")


def check_required_keys(config_dict: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the first size key missing from a config dict (either layout)."""
    if not isinstance(config_dict, dict):
        raise ValueError(f"a DeepSeek-V4.1 config must be a JSON object, got {type(config_dict).__name__}")
    if "text_config" not in config_dict:
        if _REFERENCE_MARKER_KEYS & set(config_dict):  # the flat reference layout
            missing = [key for key in _REQUIRED_REFERENCE_KEYS if key not in config_dict]
            if missing:
                raise ValueError(
                    f"the flat reference config is missing {missing[0]!r} (it needs {list(_REQUIRED_REFERENCE_KEYS)})"
                )
            return
        raise ValueError(
            "the config is missing 'text_config' (and is not the flat reference layout with 'dim', 'n_layers', "
            "'n_heads'): not a DeepSeek-V4.1 config"
        )
    text = config_dict["text_config"]
    if isinstance(text, dict):
        missing = [key for key in _REQUIRED_TEXT_KEYS if key not in text]
        if missing:
            raise ValueError(
                f"the config's text_config is missing {missing[0]!r} (it needs {list(_REQUIRED_TEXT_KEYS)})"
            )
    elif not isinstance(text, PreTrainedConfig):
        raise ValueError(f"text_config must be a JSON object, got {type(text).__name__}")


def reference_to_config_dict(ref: dict[str, Any]) -> dict[str, Any]:
    """Translate the flat reference config into our nested layout (unknown keys are kept verbatim)."""
    text: dict[str, Any] = {}
    vision: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    storage: dict[str, Any] = {}
    yarn = _default_yarn()
    for key, value in ref.items():
        if key in REFERENCE_TEXT_KEYS:
            text[REFERENCE_TEXT_KEYS[key]] = list(value) if isinstance(value, (list, tuple)) else value
        elif key in REFERENCE_VISION_KEYS:
            vision[REFERENCE_VISION_KEYS[key]] = value
        elif key == "original_seq_len":
            yarn["original_max_position_embeddings"] = value
        elif key == "rope_factor":
            yarn["factor"] = value
        elif key in ("beta_fast", "beta_slow"):
            yarn[key] = value
        elif key in ("dtype", "expert_dtype"):
            storage[key] = value
        elif key == "image_token_id":
            extra["image_token_id"] = value
        elif key in _REFERENCE_IGNORED_KEYS:
            continue
        else:
            extra[key] = value
    if yarn["original_max_position_embeddings"] <= 0:  # the reference's "no YaRN"
        yarn = {"rope_type": "default"}
    text["compress_rope_scaling"] = yarn
    if storage.get("dtype") == "fp8":  # "bf16": plain weights
        extra["quantization_config"] = released_quantization_dict(storage.get("expert_dtype") or "fp8")
    n_vision_layers = vision.get("num_hidden_layers", 0)
    return {"text_config": text, "vision_config": vision if n_vision_layers else None, **extra}


@strict
class DeepseekV41Config(PreTrainedConfig):
    r"""DeepSeek-V4.1: ``text_config`` (:class:`DeepseekV41TextConfig`) and an optional ``vision_config``
    (:class:`DeepseekV41VisionConfig`; ``None`` builds a text-only model).

    Args:
        reference_numerics (`bool`): compute every matrix product, reduction and transcendental op in fp64 and
            round it once (and the ViT's attention with portable rounding points), so that outputs do not depend on
            the CPU's BLAS, vector or scalar kernels and match DeepSeek's reference run the same way. Slower; off by
            default. See :mod:`modeling_dsv41.numerics`.
        quantization_config (`dict`, *optional*): how the weights are stored, as the released config.json says it
            (:func:`released_quantization_dict`: FP8 Linears, FP4 routed experts); ``from_pretrained`` loads such a
            folder natively (``modeling_dsv41.released``). A model built from the config holds plain weights, and
            ``save_pretrained`` of it writes none.

    Example:
        ```python
        >>> from configuration import DeepseekV41Config
        >>> config = DeepseekV41Config.from_preset("tiny")
        >>> config.text_config.hidden_size
        64
        ```
    """

    model_type = "deepseek_v41"
    # `DeepseekV41Model` holds the text backbone's modules directly (`layers`, `embed`), so its plans are the text
    # config's; the vision tower is replicated (TP/EP) or runs on the first pipeline stage.
    base_model_tp_plan = DeepseekV41TextConfig.base_model_tp_plan
    base_model_ep_plan = DeepseekV41TextConfig.base_model_ep_plan
    sub_configs_defaults = {
        "text_config": DeepseekV41TextConfig,
        "vision_config": SubConfigSpec(DeepseekV41VisionConfig, optional=True),
    }
    keys_to_ignore_at_inference = ["past_key_values"]
    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 129264
    reference_numerics: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.architectures is None:
            self.architectures = ["DeepseekV41ForCausalLM"]
        legacy_storage = kwargs.pop("released_storage", None) or {}  # how this package's earlier configs said it
        if legacy_storage.get("dtype") == "fp8" and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = released_quantization_dict(legacy_storage.get("expert_dtype") or "fp8")
        super().__post_init__(**kwargs)
        if self.vision_config is not None and not 0 <= self.image_token_id < self.text_config.vocab_size:
            raise ValueError(
                f"image_token_id {self.image_token_id} is outside the vocabulary ({self.text_config.vocab_size})"
            )

    @property
    def auto_map(self) -> dict:
        """The remote-code map of config.json (the models' ``save_pretrained`` writes one); an empty dict for a
        folder without one (``dsv41 convert``, a bare config), as tools that read the attribute expect (transformers'
        Auto classes test membership, TRL's loading by path reads it), and not written to config.json while empty."""
        return self.__dict__.setdefault("auto_map", {})

    @auto_map.setter
    def auto_map(self, value: dict) -> None:
        self.__dict__["auto_map"] = value

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        if not output.get("auto_map", True):
            del output["auto_map"]
        return output

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """Accepts our nested layout and the flat reference ``inference/config.json`` layout. The size keys must be
        present (see :func:`check_required_keys`)."""
        check_required_keys(config_dict)
        if is_reference_config(config_dict):
            config_dict = reference_to_config_dict(config_dict)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_reference_dict(cls, reference: dict[str, Any], **kwargs: Any) -> "DeepseekV41Config":
        """Build from DeepSeek's flat ``ModelArgs`` dict (``inference/config.json``)."""
        return cls(**reference_to_config_dict(reference), **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "DeepseekV41Config":
        """A shipped preset: ``"deepseek-v4.1-flash"`` (released sizes) or ``"tiny"`` (tests, demos)."""
        path = PRESETS_DIR / f"{name}.json"
        if not path.is_file():
            available = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
            raise ValueError(f"unknown preset {name!r}; available: {available}")
        config_dict = json.loads(path.read_text())
        config_dict.update(overrides)
        return cls.from_dict(config_dict)


__all__ = [
    "DeepseekV41Config",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "LayerSpec",
    "PRESETS_DIR",
    "REFERENCE_TEXT_KEYS",
    "REFERENCE_VISION_KEYS",
    "check_required_keys",
    "released_quantization_dict",
]
