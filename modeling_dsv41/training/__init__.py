"""Training: :class:`~.trainer.DeepseekV41Trainer` (the mixed optimizer of :mod:`modeling_dsv41.optim` and
per-modality router balancing, :mod:`.router_balancing`) FSDP2 sharding (:mod:`.fsdp`) and the LoRA fine-tuning planner
(:mod:`.planning`). Loaded on first use: inference does not need it."""
