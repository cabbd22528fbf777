"""``Trainer`` for DeepSeek-V4.1: the mixed optimizer of docs/design.md §6 and per-modality router-bias balancing.

:class:`DeepseekV41Trainer` changes two things in ``transformers.Trainer``:

- ``create_optimizer`` builds one :class:`~.optim.MixedOptimizer` (Muon, head-wise Muon, Sinkhorn-balanced and
  AdamW groups chosen by parameter name) and logs its assignment table once;
- it adds :class:`RouterBiasBalancingCallback`: after every optimizer step each MoE layer's ``gate.bias`` moves by
  the text tokens' expert load and ``gate.bias_vl`` by the image-span tokens' load, counted by the model's own
  training forward passes over the whole step (all micro-batches and processes). The callback alone does the same
  in any other ``Trainer`` subclass (TRL's). Adapter training leaves the biases as loaded (they belong to the
  frozen base, which an adapter does not save).

With ``push_to_hub=True`` it adds :class:`~.hub_push.RemoteCodeCallback`, so that each push during training loads with
``trust_remote_code=True``. It also makes checkpoints atomic (:mod:`.checkpointing`): each is written into
``tmp-checkpoint-N/`` and renamed to ``checkpoint-N`` once complete, so a process killed mid-save leaves no
``checkpoint-N`` that resuming would pick and crash on; resuming skips, with a warning, any ``checkpoint-N`` without
``trainer_state.json`` (written last; left by older saves).
NaN / inf losses are logged as they are (``logging_nan_inf_filter`` defaults to ``False``).

Under accelerate's FSDP2 plugin (``fsdp_version: 2``) it shards the model itself with :func:`~.fsdp.shard_model`
before accelerate prepares it, so that the units are the ones that keep the forward exact and the fp32 modules stay
fp32 under bf16 mixed precision. ``accelerate launch`` runs the configured strategy on CPU processes (gloo) too, and
refuses one accelerate would drop (:mod:`.launch`).

``torch_compile=True`` compiles each decoder layer and DSpark block as one graph (:mod:`.compilation`, inside the
FSDP2 units when sharded) rather than accelerate's whole-model ``torch.compile``.

Everything else (gradient accumulation, bf16 autocast, gradient checkpointing, DDP, checkpoints and resuming) is
``Trainer``'s own: the biases are persistent model buffers, so checkpoints carry them, and the counts are empty
whenever a checkpoint is written (right after an optimizer step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import rotate_checkpoints
from transformers.training_args import OptimizerNames

from ..released.native_precision import check_trainable
from ..optim import KINDS, MixedOptimizer, assignment_table, build_param_groups, freeze_default_parameters
from . import checkpointing
from .checkpointing import StagedCheckpoint, is_complete_checkpoint, last_complete_checkpoint, remove_interrupted_saves
from .compilation import compile_blocks
from .expert_parallel import check_expert_parallel_arguments, check_expert_parallel_trainer
from .hub_push import RemoteCodeCallback
from .launch import honour_launch_strategy, use_cpu_without_accelerator
from .offload import offload_checkpointed_inputs
from .router_balancing import RouterBiasBalancer, is_adapter_model

logger = logging.getLogger(__name__)


@dataclass
class DeepseekV41TrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus DeepSeek-V4.1's knobs.

    The optimizer is always :class:`~.optim.MixedOptimizer`, so ``optim`` must stay AdamW (its default; for plain
    AdamW everywhere set ``optimizer_overrides={".": "adamw"}``). ``learning_rate`` is shared by every kind (Muon
    and Sinkhorn updates are RMS-matched to AdamW's); ``weight_decay`` applies to the Muon kinds (matrices);
    ``adam_beta1``/``adam_beta2``/``adam_epsilon`` configure the AdamW group (norms, biases, sinks, LoRA factors),
    which takes no weight decay. On a machine without an accelerator ``use_cpu`` is set (so that ``accelerate launch``
    runs the processes on CPU with gloo, and bf16 mixed precision on CPU).
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
        metadata={"help": "Freeze the indexer (docs/design.md §6; DDP needs it)."},
    )
    train_dspark_head: bool = field(
        default=False,
        metadata={
            "help": "Train only the DSpark draft head (mtp.*) on the frozen backbone's own predictions "
            "(DeepseekV41ForCausalLM.dspark_loss); router balancing is off (the backbone is frozen)."
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Under FSDP2: split the routed experts by expert over this many neighbouring processes (tokens "
            "dispatched to them by all-to-all), everything else sharded over all (training.fsdp.shard_model). Full "
            "fine-tuning, or LoRA of the natively loaded release."
        },
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "Replace NaN/inf training losses by the running average when logging. Off by default: a "
            "diverged run must show a NaN loss (with the filter, a first logging window of NaNs reads 0.0)."
        },
    )
    offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Keep the checkpointed decoder layers' inputs in host memory until their backward (needs "
            "activation_checkpointing; a tensor the layers share is copied once); see training/offload.py."
        },
    )

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "optimizer_kind_kwargs", "optimizer_overrides"]

    def __post_init__(self) -> None:
        self.use_cpu = use_cpu_without_accelerator(self.use_cpu)
        super().__post_init__()
        if self.optim not in (OptimizerNames.ADAMW_TORCH, OptimizerNames.ADAMW_TORCH_FUSED) or self.optim_args:
            raise ValueError(
                f"DeepseekV41Trainer always trains with MixedOptimizer, so optim={self.optim.value!r}"
                f"{' and optim_args' if self.optim_args else ''} would be ignored: choose kinds and hyperparameters "
                "with optimizer_overrides / optimizer_kind_kwargs instead"
            )
        if not self.bias_update_speed >= 0:
            raise ValueError(f"bias_update_speed must be >= 0, got {self.bias_update_speed}")
        unknown = set(self.optimizer_kind_kwargs or {}) - set(KINDS)
        if unknown:
            raise ValueError(f"optimizer_kind_kwargs has unknown kinds {sorted(unknown)}; known: {list(KINDS)}")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "offload_activations keeps the checkpointed layers' inputs in host memory: set "
                "activation_checkpointing=True too"
            )
        if self.offload_activations and (self.activation_checkpointing_kwargs or {}).get("offload"):
            raise ValueError(
                "offload_activations and activation_checkpointing_kwargs['offload'] both offload the "
                "checkpointed inputs: keep one"
            )
        check_expert_parallel_arguments(self)


def _freeze_default_parameters(model: nn.Module) -> None:
    """:func:`~.optim.freeze_default_parameters`, warning when it freezes parameters an adapter made trainable (an
    adapter on the indexer, whose top-k passes no gradient, would never train)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = [name for name in freeze_default_parameters(model) if name in trainable]
    if frozen and is_adapter_model(model):
        count = sum(p.numel() for name, p in model.named_parameters() if name in set(frozen))
        logger.warning(
            "DeepseekV41Trainer froze %d adapter tensors (%d parameters) on the indexer, which receives no gradient "
            "(its top-k selection is not differentiable), e.g. %s. Leave the indexer out of target_modules (see the "
            "README's LoRA recipe), or set freeze_default_parameters=False to keep them trainable",
            len(frozen),
            count,
            frozen[0],
        )


class RouterBiasBalancingCallback(TrainerCallback):
    """Per-modality aux-loss-free router balancing for any ``Trainer`` (TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer`` included): add it to ``callbacks=[...]``.

    It binds a :class:`~.router_balancing.RouterBiasBalancer` to the model when training begins (the model's
    training forward passes count the expert loads themselves, whoever computes the loss), moves the biases after
    every optimizer step and unbinds when training ends. Adapter training is refused (see the balancer).
    """

    def __init__(self, speed: float = 1e-3):
        if not speed > 0:
            raise ValueError(f"the bias update speed must be > 0, got {speed} (leave the callback out to disable it)")
        self.speed = speed
        self.balancer: RouterBiasBalancer | None = None

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs):
        if self.balancer is not None:
            self.balancer.close()
        self.balancer = RouterBiasBalancer(model, self.speed)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # fp16 loss scaling skips the step when gradients overflow: the weights stay, so must the biases
        if getattr(optimizer, "step_was_skipped", False):
            self.balancer.discard()
        else:
            self.balancer.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.balancer.close()


class DeepseekV41Trainer(Trainer):
    """``Trainer`` with DeepSeek-V4.1's mixed optimizer and per-modality aux-loss-free router balancing.

    Takes :class:`DeepseekV41TrainingArguments`. With ``freeze_default_parameters`` (default) the indexer is frozen
    at construction (the balancing biases are buffers, moved only by the balancing rule). The assignment table
    (tensors, parameters and optimizer-state bytes per kind) is logged at INFO by ``modeling_dsv41.training.trainer``
    and kept in ``self.assignment_table``.
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
        if model is not None:
            check_trainable(model)  # a natively loaded (FP8/FP4) model: our refusal, before any freezing
        if args.freeze_default_parameters and model is not None:
            _freeze_default_parameters(model)
        if args.train_dspark_head:
            _freeze_all_but_the_draft_head(model)
        elif model is not None:
            _freeze_the_draft_head(model)
        super().__init__(model=model, args=args, **kwargs)
        for process_logger in (logger, checkpointing.logger):
            process_logger.setLevel(self.args.get_process_log_level())
        self.assignment_table = None
        self.router_balancing = None
        self._staging_run_dir: str | None = None
        if args.bias_update_speed > 0 and is_adapter_model(self.model):
            logger.warning(
                "Training adapters: the router biases are part of the frozen base and stay as loaded (no balancing), "
                "so the saved adapter reloads as the model it trained (bias_update_speed=0 silences this)"
            )
        elif args.bias_update_speed > 0 and not args.train_dspark_head:
            self.router_balancing = RouterBiasBalancingCallback(args.bias_update_speed)
            self.add_callback(self.router_balancing)
        if args.push_to_hub:
            self.add_callback(RemoteCodeCallback())

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        """As Trainer's, without the dynamo plugin: ``torch_compile`` compiles block by block
        (:func:`~.compilation.compile_blocks`, in :meth:`_prepare_for_training`), not the whole model in accelerate."""
        args = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile:
            args.pop("dynamo_plugin", None)
        return args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        honour_launch_strategy(self)  # FSDP2 on CPU processes too; a strategy accelerate dropped is an error
        check_expert_parallel_trainer(self)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """One :class:`MixedOptimizer` for the whole model (docs/design.md §6 policy, see :mod:`.optim.policy`)."""
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

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """``Trainer.create_scheduler``, which the Trainer calls once the optimizer is prepared: first, the optimizer's
        parameters are the model's again (:meth:`_restore_optimizer_parameters`)."""
        self._restore_optimizer_parameters()
        return super().create_scheduler(num_training_steps, optimizer)

    def _restore_optimizer_parameters(self) -> None:
        """Point every param group of the :class:`MixedOptimizer` at the model's parameters named in its
        ``param_names``. accelerate's FSDP2 preparation swaps each optimizer parameter for the model's by its
        ``data_ptr()``; parameters already sharded whose local shard is empty on a rank (a LoRA ``lora_A`` of rank
        r < the number of processes) share one, so they would all become one parameter there, trained with every
        gradient of theirs in turn and checkpointed under one name (a resumed run would not continue the same one)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer
        if not isinstance(optimizer, MixedOptimizer):
            return
        named = dict(self.model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [named[name] for name in group["param_names"]]

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.args.offload_activations:  # train() has enabled gradient checkpointing by now
            offload_checkpointed_inputs(self.model)
        self.shard_model()
        if self.args.torch_compile:  # inside the FSDP2 units once sharded, as torchtitan compiles
            compile_blocks(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def shard_model(self) -> None:
        """Under accelerate's FSDP2 plugin, shard the model as training will (:func:`~.fsdp.shard_model` with the
        configured mixed precision, resharding and offload); otherwise nothing. ``train()`` calls it; call it first
        for a model built on the meta device, then fill it with :func:`~.fsdp.load_sharded_weights` (each rank reads
        its shards: ``examples/lora_released.py``)."""
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
            self._shard_with_fsdp2()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; a PEFT model sharded with FSDP2 saves its adapters (``adapter_model.safetensors``,
        gathered from the shards), never the frozen base (accelerate's full state dict would gather the whole model
        on one process)."""
        from torch.distributed.fsdp import FSDPModule

        if not (isinstance(self.model, FSDPModule) and is_adapter_model(self.model)):
            return super().save_model(output_dir, _internal_call=_internal_call)
        from torch.distributed.tensor import DTensor

        output_dir = output_dir or self.args.output_dir
        adapters = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in self.model.named_parameters()
            if p.requires_grad
        }
        if self.args.should_save:
            self.model.save_pretrained(output_dir, state_dict=adapters)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _shard_with_fsdp2(self) -> None:
        """Shard the model with :func:`~.fsdp.shard_model` before accelerate sees it (accelerate leaves a model
        that is already an ``FSDPModule`` as it is): the units are the decoder layers and ViT blocks, and under
        a low-precision ``mixed_precision`` the modules the model keeps in fp32 stay fp32, which accelerate's own
        wrapping (one policy for every unit) would cast."""
        from torch.distributed.fsdp import FSDPModule

        from .fsdp import shard_model

        plugin = self.accelerator.state.fsdp_plugin
        if isinstance(self.model, FSDPModule):  # sharded already (shard_model, e.g. on the meta device and loaded)
            plugin.auto_wrap_policy = None  # nothing for accelerate to wrap (it would look for the unsharded classes)
            return
        if plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "DeepseekV41Trainer shards the model itself under FSDP2 and needs its weights on every process: "
                "set fsdp_cpu_ram_efficient_loading: false"
            )
        if plugin.activation_checkpointing:
            raise ValueError(
                "fsdp_activation_checkpointing would wrap the layers after DeepseekV41Trainer sharded them: use "
                "activation_checkpointing=True (TrainingArguments) instead"
            )
        plugin.set_auto_wrap_policy(self.model)  # resolved on the unsharded classes, as accelerate expects
        units = set(getattr(self.model, "_no_split_modules", None) or ())
        if set(plugin.transformer_cls_names_to_wrap or units) != units or plugin.min_num_params:
            logger.warning(
                "DeepseekV41Trainer shards %s as FSDP2 units; the configured wrap policy (%s) is not used",
                sorted(units),
                plugin.transformer_cls_names_to_wrap or f"min_num_params={plugin.min_num_params}",
            )
        policy = plugin.mixed_precision_policy
        if policy is not None and policy.param_dtype not in (None, torch.float32):
            for param in self.model.parameters():  # fp32 masters, as accelerate's FSDP2 preparation makes them
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.float()
        mesh = getattr(self.accelerator, "torch_device_mesh", None)
        if mesh is not None:
            mesh = mesh[tuple(self.accelerator.parallelism_config.fsdp_dim_names)]
        shard_model(
            self.model,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=plugin.reshard_after_forward,
            offload_policy=plugin.cpu_offload,
            expert_parallel_size=self.args.expert_parallel_size,
        )

    def _clip_grad_norm(self, model: nn.Module):
        """``Trainer._clip_grad_norm``; FSDP2's sharded gradients are clipped by a norm summed in fp64
        (:func:`~.fsdp.clip_sharded_grad_norm_`), the same on any mesh, so a run resumed on another number of
        processes clips as the original would have."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            from .fsdp import clip_sharded_grad_norm_

            return clip_sharded_grad_norm_(model.parameters(), self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """``Trainer.compute_loss``; with ``train_dspark_head``, the draft head's loss (``labels`` are not used: the
        targets are the backbone's own predictions)."""
        if not self.args.train_dspark_head:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        inputs = {key: value for key, value in inputs.items() if key != "labels"}
        output = self.accelerator.unwrap_model(model).dspark_loss(**inputs)
        return (output.loss, output) if return_outputs else output.loss

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest *complete* checkpoint (see
        :func:`last_complete_checkpoint`), and an incomplete one given by path is a clear error."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no complete checkpoint to resume from in {self.args.output_dir}")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and not is_complete_checkpoint(
            resume_from_checkpoint
        ):
            raise ValueError(
                f"cannot resume from {resume_from_checkpoint}: it holds no {TRAINER_STATE_NAME} (missing, or its save "
                "was interrupted); resume_from_checkpoint=True picks the newest complete checkpoint"
            )
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _get_output_dir(self, trial) -> str:
        # while a checkpoint is saved, Trainer writes `<run dir>/checkpoint-N` into the staging folder instead
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """``Trainer._save_checkpoint`` into ``tmp-checkpoint-N/``, then one rename to ``checkpoint-N``."""
        run_dir = Path(self._get_output_dir(trial))
        checkpoint = StagedCheckpoint(run_dir, self.state.global_step)
        if self.args.should_save:
            remove_interrupted_saves(run_dir)
        self.accelerator.wait_for_everyone()
        self._staging_run_dir = str(checkpoint.staging)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_run_dir = None
        self.accelerator.wait_for_everyone()  # every process has written its files (RNG states)
        if self.args.should_save:
            if self.state.best_model_checkpoint == str(checkpoint.staged):
                self.state.best_model_checkpoint = str(checkpoint.final)
                self.state.save_to_json(str(checkpoint.staged / TRAINER_STATE_NAME))
            checkpoint.publish()
            rotate_checkpoints(
                str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True
            )
        self.accelerator.wait_for_everyone()

    def call_model_init(self, trial=None) -> nn.Module:
        model = super().call_model_init(trial)
        if self.args.freeze_default_parameters:
            _freeze_default_parameters(model)
        return model


__all__ = [
    "DeepseekV41Trainer",
    "DeepseekV41TrainingArguments",
    "RouterBiasBalancingCallback",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
]


def _freeze_the_draft_head(model: nn.Module) -> None:
    """``requires_grad=False`` on the DSpark draft head (``mtp.*``) while the backbone trains: the backbone's loss
    never reaches it (DDP would stop on its unused parameters, the optimizer would keep state for them); train it
    afterwards with ``train_dspark_head=True``."""
    head = [param for name, param in model.named_parameters() if name.startswith("mtp.") or ".mtp." in name]
    if any(param.requires_grad for param in head):
        logger.info(
            "DSpark draft head (mtp.*) frozen: the backbone's loss does not reach it (train_dspark_head=True trains "
            "it)"
        )
        for param in head:
            param.requires_grad_(False)


def _freeze_all_but_the_draft_head(model: nn.Module | None) -> None:
    """``requires_grad=False`` on everything outside ``mtp.*`` (the shared embed and LM head included)."""
    if model is None or getattr(model, "mtp", None) is None:
        raise ValueError(
            "train_dspark_head needs a DeepseekV41ForCausalLM with the DSpark draft head (dspark_block_size > 0)"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
