"""``Trainer`` for DeepSeek-V4.1: the mixed optimizer of SPEC §6 and per-modality router-bias balancing.

:class:`DeepseekV41Trainer` changes two things in ``transformers.Trainer``:

- ``create_optimizer`` builds one :class:`~.optim.MixedOptimizer` (Muon, head-wise Muon, Sinkhorn-balanced and
  AdamW groups chosen by parameter name) and logs its assignment table once;
- after every optimizer step, :class:`~.router_balancing.RouterBiasBalancer` moves each MoE layer's ``gate.bias``
  by the text tokens' expert load and ``gate.bias_vl`` by the image-span tokens' load, counted over the whole
  step (all micro-batches and processes).

Everything else (gradient accumulation, bf16 autocast, gradient checkpointing, DDP, checkpoints and resuming) is
``Trainer``'s own: the biases are persistent model buffers, so checkpoints carry them, and the counts are empty whenever
a checkpoint is written (right after an optimizer step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.training_args import OptimizerNames

from .optim import KINDS, MixedOptimizer, assignment_table, build_param_groups, freeze_default_parameters
from .router_balancing import RouterBiasBalancer

logger = logging.getLogger(__name__)


@dataclass
class DeepseekV41TrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus DeepSeek-V4.1's knobs.

    The optimizer is always :class:`~.optim.MixedOptimizer`, so ``optim`` must stay AdamW (its default; for plain
    AdamW everywhere set ``optimizer_overrides={".": "adamw"}``). ``learning_rate`` is shared by every kind (Muon
    and Sinkhorn updates are RMS-matched to AdamW's); ``weight_decay`` applies to the Muon kinds (matrices);
    ``adam_beta1``/``adam_beta2``/``adam_epsilon`` configure the AdamW group (norms, biases, sinks, LoRA factors),
    which takes no weight decay.
    """

    bias_update_speed: float = field(
        default=1e-3,
        metadata={"help": "Router-bias balancing speed: bias += speed * sign(mean_load - load) per step; 0 disables."},
    )
    optimizer_kind_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Hyperparameters per optimizer kind (muon, muon_headwise, sinkhorn, adamw), e.g. "
            '\'{"sinkhorn": {"lr": 1e-3}}\'; they override the values taken from the arguments above.'
        },
    )
    optimizer_overrides: dict | str | None = field(
        default=None,
        metadata={
            "help": "Regex (searched in the parameter name) -> kind, 'frozen', or {'kind': ..., **hyperparameters}; "
            "checked before the default rules."
        },
    )
    freeze_default_parameters: bool = field(
        default=True,
        metadata={"help": "Freeze the indexer (SPEC §6; DDP needs it)."},
    )

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "optimizer_kind_kwargs", "optimizer_overrides"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optim not in (OptimizerNames.ADAMW_TORCH, OptimizerNames.ADAMW_TORCH_FUSED) or self.optim_args:
            raise ValueError(
                f"DeepseekV41Trainer always trains with MixedOptimizer, so optim={self.optim.value!r}"
                f"{' and optim_args' if self.optim_args else ''} would be ignored: choose kinds and hyperparameters with "
                "optimizer_overrides / optimizer_kind_kwargs instead"
            )
        if not self.bias_update_speed >= 0:
            raise ValueError(f"bias_update_speed must be >= 0, got {self.bias_update_speed}")
        unknown = set(self.optimizer_kind_kwargs or {}) - set(KINDS)
        if unknown:
            raise ValueError(f"optimizer_kind_kwargs has unknown kinds {sorted(unknown)}; known: {list(KINDS)}")


class RouterBiasBalancingCallback(TrainerCallback):
    """Applies the balancing rule after every optimizer step; (re)binds to the model at the start of training."""

    def __init__(self, speed: float):
        self.speed = speed
        self.balancer: RouterBiasBalancer | None = None

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        self.balancer = RouterBiasBalancer(model, self.speed)

    def record(self, model: nn.Module, attention_mask: torch.Tensor | None, image_token_types: torch.Tensor | None):
        """Count the expert choices of ``model``'s last training forward pass."""
        if self.balancer is None:  # a training step outside `train()`
            self.balancer = RouterBiasBalancer(model, self.speed)
        self.balancer.record(attention_mask, image_token_types)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # fp16 loss scaling skips the step when gradients overflow: the weights stay, so must the biases
        if getattr(optimizer, "step_was_skipped", False):
            self.balancer.discard()
        else:
            self.balancer.step()


class DeepseekV41Trainer(Trainer):
    """``Trainer`` with DeepSeek-V4.1's mixed optimizer and per-modality aux-loss-free router balancing.

    Takes :class:`DeepseekV41TrainingArguments`. With ``freeze_default_parameters`` (default) the indexer is frozen
    at construction (the balancing biases are buffers, moved only by the balancing rule). The assignment table (tensors, parameters and optimizer-state
    bytes per kind) is logged at INFO by ``modeling_dsv41.trainer`` and kept in ``self.assignment_table``.
    """

    args: DeepseekV41TrainingArguments

    def __init__(self, model: nn.Module | None = None, args: DeepseekV41TrainingArguments | None = None, **kwargs):
        if args is None:
            args = DeepseekV41TrainingArguments(output_dir="trainer_output")
        if not isinstance(args, DeepseekV41TrainingArguments):
            raise ValueError(
                f"DeepseekV41Trainer needs DeepseekV41TrainingArguments, got {type(args).__name__} "
                "(it carries bias_update_speed and the optimizer knobs)"
            )
        if args.freeze_default_parameters and model is not None:
            freeze_default_parameters(model)
        super().__init__(model=model, args=args, **kwargs)
        logger.setLevel(self.args.get_process_log_level())
        self.assignment_table = None
        self.router_balancing = None
        if args.bias_update_speed > 0:
            self.router_balancing = RouterBiasBalancingCallback(args.bias_update_speed)
            self.add_callback(self.router_balancing)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """One :class:`MixedOptimizer` for the whole model (SPEC §6 policy, see :mod:`.optim.policy`)."""
        if self.optimizer is not None:
            return self.optimizer
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError("DeepseekV41Trainer builds its own MixedOptimizer: do not pass optimizer_cls_and_kwargs")
        opt_model = self.model if model is None else model
        args = self.args
        kind_kwargs = args.optimizer_kind_kwargs or {}
        groups = build_param_groups(
            opt_model,
            lr=args.learning_rate,
            weight_decay=args.weight_decay,
            overrides=args.optimizer_overrides,
            muon=kind_kwargs.get("muon"),
            muon_headwise=kind_kwargs.get("muon_headwise"),
            sinkhorn=kind_kwargs.get("sinkhorn"),
            adamw={
                "betas": (args.adam_beta1, args.adam_beta2),
                "eps": args.adam_epsilon,
                **kind_kwargs.get("adamw", {}),
            },
        )
        self.optimizer = MixedOptimizer(groups, lr=args.learning_rate)
        self.assignment_table = assignment_table(opt_model, args.optimizer_overrides)
        logger.info("DeepSeek-V4.1 optimizer assignment:\n%s", self.assignment_table)
        return self.optimizer

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """``Trainer.compute_loss``; in training, also counts the experts this batch's tokens chose."""
        attention_mask, image_token_types = inputs.get("attention_mask"), inputs.get("image_token_types")
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training and self.router_balancing is not None:
            self.router_balancing.record(self.model, attention_mask, image_token_types)
        return result

    def call_model_init(self, trial=None) -> nn.Module:
        model = super().call_model_init(trial)
        if self.args.freeze_default_parameters:
            freeze_default_parameters(model)
        return model


__all__ = ["DeepseekV41Trainer", "DeepseekV41TrainingArguments", "RouterBiasBalancingCallback"]
