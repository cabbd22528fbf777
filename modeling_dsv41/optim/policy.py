"""Which parameter gets which optimizer (docs/design.md §6), decided by the parameter *names*.

- Muon: backbone matrices (attention ``wq_a``, ``wkv``, ``wo_a``, ``wo_b``, compressor, MoE gate, routed experts'
  ``down_proj`` (each expert's ``w2`` on its own) and shared experts, mHC ``hc_*_fn``), the Engram projection
  ``wkv``, ViT matrices and the aligner.
- Head-wise Muon: the query up-projection ``attn.wq_b`` (one block per attention head), the ViT's fused
  ``attn.wqkv`` (q and k per head, v whole) and the routed experts' fused ``gate_up_proj`` (each expert's ``w1``
  and ``w3`` orthogonalized apart, as when they were separate matrices).
- Sinkhorn-balanced: Engram tables, ``embed``, ``lm_head``, the DSpark head's Markov ``embed``/``head``.
- AdamW: norms, biases, ``attn_sink``, ``hc_*_base``/``hc_*_scale``, Engram ``q_weight``/``k_weight``, the
  image delimiter vectors, any other 0-/1-D parameter, and LoRA factors.
- Frozen by default (left out of the optimizer): the indexer (its discrete top-k passes no gradient). The MoE
  balancing biases ``gate.bias``/``gate.bias_vl`` are buffers, not parameters: the balancing rule moves them.
  :func:`build_param_groups` never changes ``requires_grad``; :func:`freeze_default_parameters` does, for
  code that needs it (e.g. DDP, which insists that every trainable parameter receives a gradient).

Names may carry a wrapper prefix (``model.``, ``model.language_model.``) and PEFT's decorations
(``base_model.model.``, ``.base_layer``, ``.modules_to_save.default``); rules match the name without them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .kinds import KINDS, OPTIMIZER_KINDS

FROZEN = "frozen"

# First match wins; patterns are searched in the canonical name (see canonical_name).
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.", "adamw"),
    (r"(^|\.)attn\.indexer\.", FROZEN),
    (r"(^|\.)engram\.embed\.weight$", "sinkhorn"),
    (r"(^|\.)(embed|lm_head)\.weight$", "sinkhorn"),
    # the DSpark draft head (mtp.*): its Markov bias is a token embedding and an output head; its blocks are matched
    # by the backbone's rules below (same module names)
    (r"(^|\.)markov_head\.(embed|head)\.weight$", "sinkhorn"),
    (r"(^|\.)confidence_head\.proj\.weight$", "adamw"),  # [1, D + rank]: one output, a vector
    (r"(^|\.)main_proj\.weight$", "muon"),
    (r"(^|\.)attn\.wq_b\.weight$", "muon_headwise"),
    (r"(^|\.)vision\.blocks\.\d+\.attn\.wqkv\.weight$", "muon_headwise"),
    (r"(^|\.)ffn\.experts\.gate_up_proj$", "muon_headwise"),
    (r"\.bias$", "adamw"),
    (r"norm\d?\.weight$", "adamw"),
    (r"(^|\.)attn\.attn_sink$", "adamw"),
    (r"(^|\.)hc_(attn|ffn)_(base|scale)$", "adamw"),
    (r"(^|\.)engram\.(q_weight|k_weight)$", "adamw"),
    (r"(^|\.)image_(start|end|newline)$", "adamw"),
    (r"(^|\.)attn\.(wq_a|wkv|wo_a|wo_b)\.weight$", "muon"),
    (r"(^|\.)attn\.compressor\.(wkv|wgate)\.weight$", "muon"),
    (r"(^|\.)ffn\.gate\.weight$", "muon"),
    (r"(^|\.)ffn\.shared_experts\.w[123]\.weight$", "muon"),
    (r"(^|\.)ffn\.experts\.down_proj$", "muon"),  # [E, D, I]: each expert's matrix on its own
    (r"(^|\.)hc_(attn|ffn)_fn$", "muon"),
    (r"(^|\.)engram\.wkv\.weight$", "muon"),
    (r"(^|\.)vision\.patch_embed\.proj\.weight$", "muon"),
    (r"(^|\.)vision\.blocks\.\d+\.attn\.wo\.weight$", "muon"),
    (r"(^|\.)vision\.blocks\.\d+\.mlp\.w[12]\.weight$", "muon"),
    (r"(^|\.)aligner\.w[12]\.weight$", "muon"),
)
_DEFAULT_FROZEN = tuple(re.compile(pattern) for pattern, kind in DEFAULT_RULES if kind == FROZEN)
_PEFT_DECORATIONS = re.compile(r"^base_model\.model\.|\.base_layer(?=\.)|\.modules_to_save\.default(?=\.)")

Override = str | Mapping[str, Any]


def canonical_name(name: str) -> str:
    """Strip PEFT's decorations: ``base_model.model.x.base_layer.weight`` → ``x.weight``."""
    return _PEFT_DECORATIONS.sub("", name)


def assign_kinds(model: nn.Module, overrides: Mapping[str, Override] | None = None) -> dict[str, str]:
    """``{parameter name: kind}`` for every parameter; ``"frozen"`` for those the optimizer leaves alone.

    ``overrides`` maps a regex (searched in the canonical name, checked before the default rules, first match
    wins) to a kind, to ``"frozen"``, or to a dict ``{"kind": ..., **group hyperparameters}``.
    """
    return {name: kind for name, (kind, _) in _assign(model, overrides).items()}


def build_param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    overrides: Mapping[str, Override] | None = None,
    muon: Mapping[str, Any] | None = None,
    muon_headwise: Mapping[str, Any] | None = None,
    sinkhorn: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~.mixed.MixedOptimizer` implementing docs/design.md §6 on ``model``.

    ``lr`` is shared by every group; ``weight_decay`` applies to the Muon kinds (whose update RMS matches
    AdamW's, so both mean the same). The AdamW group defaults to no weight decay (it holds gains, biases and
    sinks, as in transformers' Trainer) and DeepSeek-V3's ``betas=(0.9, 0.95)``. Each keyword named after a
    kind overrides that kind's hyperparameters (``muon_headwise`` starts from ``muon``'s), e.g.
    ``sinkhorn={"lr": 1e-3}``; override dicts in ``overrides`` override both. Head counts come from
    ``model.config`` (``text_config.num_attention_heads``, or the config itself when it is the text config,
    and ``vision_config.hidden_size``/``num_attention_heads``). Parameters with ``requires_grad=False`` are
    skipped. Groups carry ``param_names``.
    """
    per_kind: dict[str, dict[str, Any]] = {
        "muon": {"lr": lr, "weight_decay": weight_decay, **(muon or {})},
        "sinkhorn": {"lr": lr, **(sinkhorn or {})},
        "adamw": {"lr": lr, "weight_decay": 0.0, "betas": (0.9, 0.95), **(adamw or {})},
    }
    per_kind["muon_headwise"] = {**per_kind["muon"], **(muon_headwise or {})}
    named = dict(model.named_parameters())
    groups: dict[tuple, dict[str, Any]] = {}
    for name, (kind, extra) in _assign(model, overrides).items():
        if kind == FROZEN:
            continue
        hparams = {**per_kind[kind], **extra}
        if kind == "muon_headwise" and "num_heads" not in hparams:
            hparams.update(_head_layout(model, name))
        key = (kind, *sorted((k, repr(v)) for k, v in hparams.items()))
        group = groups.setdefault(key, {"kind": kind, "params": [], "param_names": [], **hparams})
        group["params"].append(named[name])
        group["param_names"].append(name)
    return list(groups.values())


def freeze_default_parameters(model: nn.Module) -> list[str]:
    """Set ``requires_grad=False`` on what docs/design.md §6 freezes (the indexer); returns their names."""
    frozen = []
    for name, p in model.named_parameters():
        if any(pattern.search(canonical_name(name)) for pattern in _DEFAULT_FROZEN):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


@dataclass
class KindSummary:
    tensors: int = 0
    parameters: int = 0
    state_bytes: int = 0  # optimizer state the kind needs for these tensors


@dataclass
class AssignmentTable:
    """Per-kind totals and the per-name assignment; ``str()`` renders the table."""

    kinds: dict[str, KindSummary] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{'kind':<14}{'tensors':>9}{'parameters':>18}{'state bytes':>18}"]
        for kind, row in self.kinds.items():
            lines.append(f"{kind:<14}{row.tensors:>9,}{row.parameters:>18,}{row.state_bytes:>18,}")
        total = KindSummary(
            sum(r.tensors for r in self.kinds.values()),
            sum(r.parameters for r in self.kinds.values()),
            sum(r.state_bytes for r in self.kinds.values()),
        )
        lines.append(f"{'total':<14}{total.tensors:>9,}{total.parameters:>18,}{total.state_bytes:>18,}")
        return "\n".join(lines)


def assignment_table(model: nn.Module, overrides: Mapping[str, Override] | None = None) -> AssignmentTable:
    """Kind → tensor count, parameter count and optimizer-state bytes (works on the meta device)."""
    kinds = assign_kinds(model, overrides)
    table = AssignmentTable(kinds={kind: KindSummary() for kind in (*KINDS, FROZEN)}, names=kinds)
    for name, p in model.named_parameters():
        row = table.kinds[kinds[name]]
        row.tensors += 1
        row.parameters += p.numel()
        row.state_bytes += state_bytes(kinds[name], p.numel(), p.element_size())
    return table


def state_bytes(kind: str, numel: int, element_size: int) -> int:
    """Bytes of optimizer state MixedOptimizer keeps for one tensor of ``kind`` (buffers in the param dtype)."""
    return 0 if kind == FROZEN else OPTIMIZER_KINDS[kind].state_bytes(numel, element_size)


def _assign(model: nn.Module, overrides: Mapping[str, Override] | None) -> dict[str, tuple[str, dict[str, Any]]]:
    rules = [(re.compile(pattern), *_parse_override(value)) for pattern, value in (overrides or {}).items()]
    rules += [(re.compile(pattern), kind, {}) for pattern, kind in DEFAULT_RULES]
    assigned, unknown = {}, []
    for name, p in model.named_parameters():
        canonical = canonical_name(name)
        match = next(((kind, extra) for pattern, kind, extra in rules if pattern.search(canonical)), None)
        if not p.requires_grad:
            match = (FROZEN, {})
        elif match is None and p.ndim <= 1:
            match = ("adamw", {})
        elif match is None:
            unknown.append(f"{name} {tuple(p.shape)}")
            continue
        assigned[name] = match
    if unknown:
        raise ValueError("no optimizer rule for these parameters (add an `overrides` pattern): " + ", ".join(unknown))
    return assigned


def _parse_override(value: Override) -> tuple[str, dict[str, Any]]:
    extra = {"kind": value} if isinstance(value, str) else dict(value)
    kind = extra.pop("kind", None)
    if kind not in (*KINDS, FROZEN):
        raise ValueError(f"override kind must be one of {(*KINDS, FROZEN)}, got {kind!r}")
    allowed = set() if kind == FROZEN else {"lr", *OPTIMIZER_KINDS[kind].keys}
    if set(extra) - allowed:
        raise ValueError(f"unknown keys {sorted(set(extra) - allowed)} in a {kind!r} override")
    return kind, extra


def _head_layout(model: nn.Module, name: str) -> dict[str, Any]:
    """``num_heads``/``split_sizes`` of a head-wise weight, from the model config."""
    config = getattr(model, "config", None)
    canonical = canonical_name(name)
    if re.search(r"(^|\.)vision\.blocks\.\d+\.attn\.wqkv\.weight$", canonical):
        vision = getattr(config, "vision_config", None)
        hidden = getattr(vision, "hidden_size", None)
        heads = getattr(vision, "num_attention_heads", None)
        if hidden is None or heads is None:
            raise ValueError(f"{name} is head-wise: model.config.vision_config needs hidden_size, num_attention_heads")
        return {"num_heads": (heads, heads, 1), "split_sizes": (hidden, hidden, hidden)}  # q, k per head; v whole
    if re.search(r"(^|\.)attn\.wq_b\.weight$", canonical):
        text = getattr(config, "text_config", None)
        text = config if text is None else text
        heads = getattr(text, "num_attention_heads", None)
        if heads is None:
            raise ValueError(f"{name} is head-wise but the model config has no num_attention_heads")
        return {"num_heads": heads}
    if re.search(r"(^|\.)ffn\.experts\.gate_up_proj$", canonical):
        text = getattr(config, "text_config", None)
        intermediate = getattr(config if text is None else text, "moe_intermediate_size", None)
        if intermediate is None:
            raise ValueError(f"{name} is head-wise but the model config has no moe_intermediate_size")
        return {"num_heads": (1, 1), "split_sizes": (intermediate, intermediate)}  # w1 rows, then w3 rows
    raise ValueError(f"{name}: give num_heads in its override to use muon_headwise")
