"""Tensor- and expert-parallel loading of DeepSeek-V4.1: which ``DistributedConfig`` combinations work, checked
before transformers builds its meshes, so an unsupported one is one clear error that names one that works.

transformers runs the config's plans (``base_model_tp_plan`` / ``base_model_ep_plan``). What its errors do not say:

* expert parallelism runs on the tensor-parallel ranks: transformers wants ``ep_size`` a multiple of ``tp_size``
  dividing ``fsdp_size * tp_size``, so ``DistributedConfig(ep_size=N)`` alone fails in its constructor with
  "`ep_size` must divide `fsdp_size * tp_size`". :func:`distributed_config` builds the config and answers that
  with ``DistributedConfig(tp_size=N, ep_size=N)`` (experts split by EP, the rest by the TP plan);
* the released storage scales 32 values at a time (32x32 blocks for FP8 Linears, 32 columns per row for the FP4
  experts), and the TP plan splits ``moe_intermediate_size`` (I) of the routed and shared experts: each rank must
  get a multiple of 32 of it;
* transformers' load-time FSDP (``DistributedConfig(fsdp_size=N)``) cannot shard the natively loaded weights (FP8
  values, E8M0 scales and FP4 bytes side by side, cast to one dtype); :func:`~.training.fsdp.shard_model` shards a
  loaded native model (LoRA training) instead;
* expert parallelism needs whole experts per rank, the DSpark draft blocks' too (their MoE has its own count).
"""

from __future__ import annotations

import os

from configuration.configuration_dsv41 import DeepseekV41Config

from .codec import RELEASED_BLOCK_SIZE


def distributed_config(**sizes):
    """``transformers.distributed.DistributedConfig(**sizes)``, with a combination transformers refuses for expert
    parallelism answered by one that works (see the module docstring)."""
    from transformers.distributed import DistributedConfig

    try:
        return DistributedConfig(**sizes)
    except ValueError as error:
        if "ep_size" not in str(error):
            raise
        ep = sizes.get("ep_size")
        raise ValueError(
            f"DistributedConfig({', '.join(f'{k}={v!r}' for k, v in sizes.items())}): {error} Expert parallelism "
            f"runs on the tensor-parallel ranks: use DistributedConfig(tp_size={ep}, ep_size={ep}) (the experts "
            "split by the EP plan, the rest by the TP plan)"
        ) from None


def requested_parallelism(kwargs: dict):
    """The ``DistributedConfig`` a ``from_pretrained(**kwargs)`` call asks for (transformers turns a bare
    ``tp_plan`` / ``tp_size`` into one the same way), or None."""
    if kwargs.get("distributed_config") is not None:
        return kwargs["distributed_config"]
    if kwargs.get("tp_plan") is None and kwargs.get("tp_size") is None:
        return None
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_plan=kwargs.get("tp_plan"), tp_size=kwargs.get("tp_size"))


def working_tp_sizes(config: DeepseekV41Config, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` that leave every rank whole 32-wide scale blocks of I."""
    inter = config.get_text_config().moe_intermediate_size
    return [size for size in range(1, limit + 1) if inter % (RELEASED_BLOCK_SIZE * size) == 0]


def check_parallel_load(config: DeepseekV41Config, parallel, native: bool, released: bool) -> None:
    """Refuse, before loading, a ``DistributedConfig`` (``parallel``) that cannot load this checkpoint: ``native``
    (released FP8/FP4 weights kept as stored), ``released`` (block-scaled storage, native or dequantized on load)."""
    if parallel is None:
        return
    text = config.get_text_config()
    tp, ep = parallel.tp_size or 1, parallel.ep_size or 1
    fsdp, replicas = parallel.fsdp_size or 1, parallel.dp_replicate_size or 1
    world = int(os.environ.get("WORLD_SIZE", tp * fsdp * replicas))
    if native and fsdp * replicas > 1:
        ranks = tp * fsdp
        raise ValueError(
            f"FSDP (fsdp_size={fsdp}, dp_replicate_size={replicas}) cannot shard the natively loaded released weights "
            f"(FP8 values, E8M0 scales and FP4 bytes in one parameter group): for inference use "
            f"DistributedConfig(tp_size={ranks}) or DistributedConfig(tp_size={ranks}, ep_size={ranks}); to train "
            "LoRA adapters with FSDP2, load without a DistributedConfig and shard the model with "
            "modeling_dsv41.training.fsdp.shard_model (DeepseekV41Trainer does under accelerate's FSDP2); to train "
            "every weight, load with quantization_config=FineGrainedFP8Config(dequantize=True)"
        )
    if released and tp > 1 and text.moe_intermediate_size % (RELEASED_BLOCK_SIZE * tp):
        sizes = [size for size in working_tp_sizes(config, max(world, tp)) if size > 1]
        instead = (
            f"use tp_size in {sizes}" if sizes else "no tp_size > 1 does for this config: load it with device_map"
        )
        raise ValueError(
            f"tp_size={tp} splits moe_intermediate_size={text.moe_intermediate_size} of the released storage into "
            f"{text.moe_intermediate_size / tp:g} per rank, which cuts its {RELEASED_BLOCK_SIZE}-wide E8M0 scale "
            f"blocks: {instead}"
        )
    counts = {"n_routed_experts": text.n_routed_experts}
    if text.has_dspark:  # the draft blocks' experts follow the same EP plan
        counts["dspark_n_routed_experts"] = text.dspark_num_routed_experts
    for name, count in counts.items():
        if ep > 1 and count % ep:
            sizes = [
                size
                for size in range(2, world + 1)
                if all(n % size == 0 for n in counts.values()) and world % size == 0
            ]
            raise ValueError(
                f"ep_size={ep} does not divide {name}={count} (whole experts per rank): use ep_size in {sizes}"
            )


__all__ = ["check_parallel_load", "distributed_config", "requested_parallelism", "working_tp_sizes"]
