"""What a DeepSeek-V4.1 configuration costs, computed on the meta device (no memory, works for the released size):
parameters per component and per optimizer kind, optimizer-state bytes (MixedOptimizer vs AdamW) and the LM
positions images of a few sizes take. Backs ``dsv41 inspect``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from configuration import DeepseekV41Config
from processing.image_processing_dsv41 import ImageGridPlan, plan_image_grid

from ..modeling_dsv41 import DeepseekV41ForCausalLM
from ..optim import KINDS, AssignmentTable, KindSummary, assign_kinds, state_bytes
from ..optim.policy import FROZEN
from ..placement import ParallelPlan, meta_instance
from ..training.planning import LoraTrainingPlan

# component name → pattern searched in the parameter name; the first match wins
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("DSpark draft head", r"^(model\.)?mtp\."),
    ("token embedding", r"^(model\.)?embed\."),
    ("LM head", r"^lm_head\."),
    ("norms", r"(^|\.)(attn_norm|ffn_norm|norm)\.weight$"),
    ("attention: indexer", r"\.attn\.indexer\."),
    ("attention: compressor", r"\.attn\.compressor\."),
    ("attention", r"\.attn\."),
    ("MoE: routed experts", r"\.ffn\.experts\."),
    ("MoE: shared expert", r"\.ffn\.shared_experts\."),
    ("MoE: router", r"\.ffn\.gate\."),
    ("mHC", r"\.hc_(attn|ffn)_"),
    ("Engram: tables", r"\.engram\.embed\."),
    ("Engram: projection and gate", r"\.engram\."),
    ("vision: ViT", r"^(model\.)?vision\."),
    ("vision: aligner and delimiters", r"^(model\.)?(aligner\.|image_(start|newline|end)$)"),
)
# (height, width) of the images whose token budgets `inspect` lists
IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (224, 224),
    (544, 544),
    (1024, 768),
    (1080, 1920),
    (1302, 1302),
    (3024, 4032),
)


@dataclass
class ModelInspection:
    config: DeepseekV41Config
    dtype: torch.dtype
    components: dict[str, int] = field(default_factory=dict)
    assignment: AssignmentTable = field(default_factory=AssignmentTable)
    adamw_state_bytes: int = 0
    image_plans: dict[tuple[int, int], ImageGridPlan] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(self.components.values())

    @property
    def mixed_state_bytes(self) -> int:
        return sum(row.state_bytes for row in self.assignment.kinds.values())


def build_meta_model(
    config: DeepseekV41Config, cls: type = DeepseekV41ForCausalLM, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """``cls`` (the causal LM by default) of ``config`` on the meta device, as :func:`~..placement.meta_instance`."""
    return meta_instance(config, cls, dtype)


def component_of(name: str) -> str:
    """The :data:`COMPONENTS` entry a parameter name belongs to."""
    for component, pattern in COMPONENTS:
        if re.search(pattern, name):
            return component
    raise ValueError(f"parameter {name!r} matches no component")


def inspect_config(config: DeepseekV41Config, dtype: torch.dtype = torch.bfloat16) -> ModelInspection:
    """Counts for ``config`` with parameters in ``dtype``; optimizer state is kept in the parameter dtype."""
    model = build_meta_model(config, dtype=dtype)  # the routed experts are two fused tensors per layer: quick on meta
    params = list(model.named_parameters())
    kinds = assign_kinds(model)
    result = ModelInspection(config=config, dtype=dtype)
    result.components = dict.fromkeys((c for c, _ in COMPONENTS), 0)
    result.assignment.kinds = {kind: KindSummary() for kind in (*KINDS, FROZEN)}
    for name, param in params:
        numel, row, kind = param.numel(), result.assignment.kinds[kinds[name]], kinds[name]
        row.tensors += 1
        row.parameters += numel
        row.state_bytes += state_bytes(kind, numel, param.element_size())
        result.components[component_of(name)] += numel
        if kind != FROZEN:
            result.adamw_state_bytes += state_bytes("adamw", numel, param.element_size())
    result.components = {k: v for k, v in result.components.items() if v}
    if config.vision_config is not None:
        vision = config.vision_config
        settings = {
            k: getattr(vision, k)
            for k in ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio")
        }
        result.image_plans = {size: plan_image_grid(*size, **settings) for size in IMAGE_SIZES}
    return result


def _human(n: float) -> str:
    """749,000,000,000 → ``749B`` (parameter counts)."""
    for suffix in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}" if suffix else f"{n:,.0f}"
        n /= 1000
    return f"{n:.3g}T"


def _bytes(n: int) -> str:
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or suffix == "TiB":
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n} B"
        n /= 1024


def format_inspection(result: ModelInspection) -> str:
    """The report ``dsv41 inspect`` prints."""
    total = result.num_parameters
    dtype = str(result.dtype).removeprefix("torch.")
    lines = [f"Parameters: {total:,} ({_human(total)}), {dtype} unless kept in fp32", ""]
    lines.append(f"{'component':<34}{'parameters':>20}{'share':>9}")
    for component, count in result.components.items():
        lines.append(f"{component:<34}{count:>20,}{count / total:>9.1%}")
    lines += ["", "Optimizer assignment and optimizer state:", str(result.assignment), ""]
    mixed, adamw = result.mixed_state_bytes, result.adamw_state_bytes
    lines.append(
        f"optimizer state: MixedOptimizer {_bytes(mixed)} vs AdamW on the same parameters {_bytes(adamw)} "
        f"({mixed / adamw:.0%} of AdamW)"
        if adamw
        else "optimizer state: nothing to train"
    )
    if result.image_plans:
        lines += [
            "",
            "Image token budget (positions in the LM sequence = start + rows × (tokens + newline) + end):",
            f"{'image (h×w)':<14}{'ViT canvas':>12}{'patches':>10}{'token grid':>12}{'positions':>11}",
        ]
        for (height, width), plan in result.image_plans.items():
            canvas = f"{plan.canvas_size[0]}×{plan.canvas_size[1]}"
            grid = f"{plan.token_grid[0]}×{plan.token_grid[1]}"
            size = f"{height}×{width}"
            lines.append(f"{size:<14}{canvas:>12}{plan.num_patches:>10,}{grid:>12}{plan.num_positions:>11,}")
        lines.append(f"(max_image_tokens = {result.config.vision_config.max_image_tokens})")
    else:
        lines += ["", "Text-only configuration: no vision encoder."]
    return "\n".join(lines)


# `dsv41 inspect --storage nf4 | int8`: the bitsandbytes loads compared (label → BitsAndBytesConfig options)
BITSANDBYTES_PATHS: dict[str, dict] = {
    "bitsandbytes int8": dict(load_in_8bit=True),
    "bitsandbytes NF4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bitsandbytes NF4, double quantization": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
}


def storage_costs(config: DeepseekV41Config) -> dict[str, dict[str, float]]:
    """Bytes of every parameter (by name) on each load path: bf16, native (the released FP8 / FP4 storage as native
    loading holds it), and the bitsandbytes loads of :data:`BITSANDBYTES_PATHS` (the experts quantized too, the modules
    ``from_pretrained`` skips kept; :func:`~modeling_dsv41.bnb_quantizer.quantized_storage_bytes`)."""
    from ..bnb_quantizer import DeepseekV41BitsAndBytesConfig, quantized_storage_bytes
    from ..placement import native_held_bytes
    from ..released.loading import high_precision_modules

    model = build_meta_model(config)
    costs = {
        "bf16 (fp32 where kept)": {name: p.numel() * p.element_size() for name, p in model.named_parameters()},
        "native FP8 / FP4 (released storage)": {
            name: native_held_bytes(name, p) for name, p in model.named_parameters()
        },
    }
    for label, options in BITSANDBYTES_PATHS.items():
        model = build_meta_model(config)
        skipped = high_precision_modules(model, options.get("load_in_4bit", False))
        costs[label] = quantized_storage_bytes(
            model, DeepseekV41BitsAndBytesConfig(**options, llm_int8_skip_modules=skipped)
        )
    return costs


def format_storage_costs(config: DeepseekV41Config, costs: dict[str, dict[str, float]]) -> str:
    """The table ``dsv41 inspect --storage nf4`` prints: weights and bytes per parameter on each load path, with and
    without the Engram tables (which stay in host memory or memory-mapped on the native path)."""
    from ..placement import is_engram_table_tensor

    counts = {name: p.numel() for name, p in build_meta_model(config).named_parameters()}
    total = sum(counts.values())
    rest = sum(n for name, n in counts.items() if not is_engram_table_tensor(name))
    lines = [
        f"Weights by load path ({_human(total)} parameters; {_human(rest)} without the Engram tables):",
        f"{'path':<40}{'weights':>14}{'B/param':>9}{'without Engram tables':>24}{'B/param':>9}",
    ]
    for label, sizes in costs.items():
        nbytes = sum(sizes.values())
        without = sum(b for name, b in sizes.items() if not is_engram_table_tensor(name))
        lines.append(
            f"{label:<40}{_bytes(nbytes):>14}{nbytes / total:>9.3f}{_bytes(without):>24}{without / rest:>9.3f}"
        )
    lines.append(
        "bitsandbytes: every Linear and routed expert it can quantize, with their block scales; the fp32 head, "
        "compressor and Engram projections, norms, routers, mHC and wo_a as in bf16"
    )
    return "\n".join(lines)


def format_parallel_plan(plan: ParallelPlan, max_memory: dict[int | str, int] | None, native: bool) -> str:
    """The per-rank table ``dsv41 inspect --tp N`` / ``--ep N`` prints: each component's bytes on one rank, split by
    the plans or whole on every rank."""
    storage = "released storage (FP8 Linears, FP4 experts)" if native else "loaded dtypes"
    if plan.ep_size > 1:
        title = f"Expert parallel, DistributedConfig(tp_size={plan.tp_size}, ep_size={plan.ep_size})"
    else:
        title = f'Tensor parallel, tp_plan="auto" on {plan.tp_size} ranks'
    rows: dict[tuple[str, bool], float] = {}
    for name, (nbytes, split) in plan.tensors.items():
        key = (component_of(name), split)
        rows[key] = rows.get(key, 0) + nbytes
    lines = [f"{title}, {storage}:", f"{'component':<34}{'per rank':>14}  held"]
    for (component, split), nbytes in sorted(rows.items(), key=lambda item: (not item[0][1], -item[1])):
        lines.append(f"{component:<34}{_bytes(nbytes):>14}  {'its part' if split else 'whole'}")
    total = plan.per_rank_bytes
    capacity = min(max_memory.values()) if max_memory else None
    fill = f" of {_bytes(capacity)} ({total / capacity:.0%})" if capacity else ""
    lines.append(f"{'weights per rank':<34}{_bytes(total):>14}{fill}")
    lines.append(
        f"Engram tables: {_bytes(plan.engram_table_bytes)}, whole on every rank, in host memory "
        '(engram_tables="mmap": the ranks share one page cache of the checkpoint)'
    )
    return "\n".join(lines)


def _grouped(values: dict[str, str]) -> dict[str, str]:
    """value → the names that have it (comma-separated, or "every case")."""
    groups: dict[str, list[str]] = {}
    for name, value in values.items():
        groups.setdefault(value, []).append(name)
    return {value: "every case" if len(names) == len(values) else ", ".join(names) for value, names in groups.items()}


# the columns of `dsv41 inspect --train lora`: (frozen shards and optimizer state offloaded, activations offloaded)
TRAINING_CASES = {
    "resident": (False, False),
    "activations offloaded": (False, True),
    "all offloaded": (True, True),
}


def format_training_plan(plans: dict[str, LoraTrainingPlan], longest: dict[str, int]) -> str:
    """The per-device table ``dsv41 inspect --devices NxSIZE --train lora`` prints: the same run with everything
    resident on the devices, with the checkpointed activations in host memory, and with the frozen shards and the
    adapters' optimizer state there too (:data:`TRAINING_CASES`); the longest sequence per device each fits."""
    first = next(iter(plans.values()))
    lines = [
        (
            f"LoRA fine-tuning (rank {first.rank}, attention + shared and routed experts: "
            f"{_human(first.adapter_parameters)} adapter parameters) on the natively loaded weights, FSDP2 over "
            f"{first.num_devices} devices (training.fsdp.shard_model"
            + (
                f", the routed experts split over {first.ep_size} of them: --expert_parallel_size {first.ep_size}"
                if first.ep_size > 1
                else ""
            )
            + f"), gradient checkpointing, micro-batch {first.batch_size} × {first.seq_len} tokens per device:"
        ),
        f"{'per device':<38}" + "".join(f"{name:>24}" for name in plans),
    ]
    offloaded = {
        "frozen shards": "offload",
        "adapters + grads + AdamW": "offload",
        "checkpointed layer inputs": "offload_activations",
    }
    for term in first.terms:
        cells = []
        for plan in plans.values():
            if term not in plan.terms:
                cells.append("host")
            elif term in offloaded and getattr(plan, offloaded[term]):
                cells.append("host")
            elif plan.terms[term] == 0 and term in ("recomputed layer", "logits + loss"):
                cells.append("-")  # the other moment: not at the peak
            else:
                cells.append(_bytes(plan.terms[term]))
        lines.append(f"{term:<38}" + "".join(f"{cell:>24}" for cell in cells))
    lines.append(f"{'total':<38}" + "".join(f"{_bytes(plan.per_device):>24}" for plan in plans.values()))
    verdicts = ["fits" if plan.fits else "does not fit" for plan in plans.values()]
    lines.append(f"{'on ' + _bytes(first.capacity) + ' devices':<38}" + "".join(f"{v:>24}" for v in verdicts))
    cells = [f"{tokens} tokens" if tokens else "none" for tokens in longest.values()]
    lines.append(f"{'longest sequence per device that fits':<38}" + "".join(f"{cell:>24}" for cell in cells))
    activations = ("checkpointed layer inputs", "recomputed layer", "logits + loss")
    moments = {
        name: f"{plan.peak_moment}: {_bytes(sum(plan.terms[term] for term in activations))}; at "
        f"{plan.other_moment[0]}: {_bytes(plan.other_moment[1])}"
        for name, plan in plans.items()
    }
    for moment, names in _grouped(moments).items():
        lines.append(f"activations ({names}) peak at {moment}")
    local = " with the rank's own routed experts" if first.ep_size > 1 else ""
    lines.append(f"largest unit gathered: {first.largest_unit}{local} (and the next one, prefetched)")
    held = {(what, _bytes(nbytes)): [] for plan in plans.values() for what, nbytes in plan.host_bytes.items()}
    for name, plan in plans.items():
        for what, nbytes in plan.host_bytes.items():
            held[what, _bytes(nbytes)].append(name)
    for (what, size), names in held.items():
        lines.append(f"host memory, {what}: {size} ({'every case' if len(names) == len(plans) else ', '.join(names)})")
    lines.append(
        f"launch (examples/lora_released.py, one process per device): host memory per node "
        f"{_bytes(first.host_bytes['Engram tables'] + first.num_devices * first.largest_read)} beyond the processes' "
        "own (the Engram tables memory-mapped, one page cache for the node, and per process the largest part of a "
        f"tensor it reads, {_bytes(first.largest_read)}: each reads only its shards), plus what a case above keeps in "
        f"host memory; disk: the released checkpoint {_bytes(first.checkpoint_bytes)}, each training checkpoint "
        f"{_bytes(first.save_bytes)} (the adapter and its AdamW moments)"
    )
    lines.append(
        "activations offloaded = shard_model(..., offload_activations=True) or the Trainer's "
        "offload_activations=True; all offloaded = also offload_policy=CPUOffloadPolicy(): frozen shards, "
        "adapters and their optimizer step in host memory"
    )
    return "\n".join(lines)


def format_full_training_plan(
    model: torch.nn.Module, nodes: int, per_node: int, capacity: int, ep_size: int, seq_len: int, batch_size: int
) -> str:
    """The per-device table ``dsv41 inspect --devices NODESxGPUSxSIZE --train full`` prints: full fine-tuning with the
    mixed optimizer on the expert-parallel mesh, in both precisions, per-device totals by EP size, and the smallest
    number of 8×80 GiB and 8×141 GiB nodes that fits."""
    from ..training.full_planning import PRECISIONS, ep_sizes, model_totals, plan_full_training, smallest_fit

    totals = {precision: model_totals(model, precision) for precision in PRECISIONS}

    def plan(precision: str, ep: int, nodes: int = nodes, per_node: int = per_node, capacity: int = capacity):
        return plan_full_training(
            model, nodes, per_node, capacity, ep, precision, seq_len, batch_size, totals[precision]
        )

    plans = [plan(precision, ep_size) for precision in PRECISIONS]
    first = plans[0]
    experts = model.config.get_text_config().n_routed_experts
    lines = [
        (
            f"Full fine-tuning ({_human(first.trainable_parameters)} trained parameters: all but the indexer, the "
            f"DSpark draft head and the Engram tables) on {nodes} × {per_node} = {first.world} devices: the routed "
            f"experts split over EP {ep_size} ({experts // ep_size} per layer on each) and FSDP2-sharded over the "
            f"other {first.ep_shard}, everything else FSDP2 over all {first.world} (training.fsdp.shard_model("
            f"expert_parallel_size={ep_size})); gradient checkpointing, micro-batch {batch_size} × {seq_len} tokens "
            "per device. MixedOptimizer state: one momentum buffer per Muon, head-wise Muon and Sinkhorn tensor, two "
            "moments per AdamW tensor, in the weights' dtype:"
        ),
        f"{'per device':<52}{PRECISIONS[0]:>14}{PRECISIONS[1]:>14}",
    ]
    for name in first.terms:
        cells = [_bytes(p.terms[name]) if name in p.terms else "-" for p in plans]
        lines.append(f"{name:<52}{cells[0]:>14}{cells[1]:>14}")
    lines.append(f"{'total':<52}{_bytes(plans[0].per_device):>14}{_bytes(plans[1].per_device):>14}")
    verdicts = ["fits" if p.fits else "does not fit" for p in plans]
    lines.append(f"{'on ' + _bytes(capacity) + ' devices':<52}{verdicts[0]:>14}{verdicts[1]:>14}")
    lines.append(f"largest layer gathered: {first.largest_layer} (and the next one, prefetched)")
    for name, nbytes in first.host_bytes.items():
        lines.append(f"host memory, {name}: {_bytes(nbytes)}")
    by_ep = [
        f"EP {ep}: {_bytes(plan(PRECISIONS[0], ep).per_device)} / {_bytes(plan(PRECISIONS[1], ep).per_device)}"
        for ep in ep_sizes(model, first.world)
        if ep > 1
    ]
    lines.append(f"per device by EP size ({' / '.join(PRECISIONS)}): " + ", ".join(by_ep))
    lines.append("smallest node count that fits (the smallest EP size that fits on it):")
    for node_capacity in (80 * 2**30, 141 * 2**30):
        cells = []
        for precision in PRECISIONS:
            best = smallest_fit(model, 8, node_capacity, precision, seq_len, batch_size)
            cells.append(
                f"{precision} {best.nodes} nodes (EP {best.ep_size}, {_bytes(best.per_device)})"
                if best
                else f"{precision}: more than 256 nodes"
            )
        lines.append(f"  8 × {_bytes(node_capacity)} nodes: " + "; ".join(cells))
    lines.append(
        "fp32 master = DeepseekV41Trainer under accelerate's mixed_precision: bf16 (fp32 weights, gradients and "
        "state; bf16 compute and reduction); bf16 = the model loaded in bf16, mixed_precision: no"
    )
    return "\n".join(lines)


__all__ = [
    "BITSANDBYTES_PATHS",
    "COMPONENTS",
    "IMAGE_SIZES",
    "ModelInspection",
    "build_meta_model",
    "component_of",
    "format_inspection",
    "format_full_training_plan",
    "format_parallel_plan",
    "format_storage_costs",
    "format_training_plan",
    "inspect_config",
    "storage_costs",
    "TRAINING_CASES",
]
