"""Aux-loss-free MoE load balancing per modality (DeepSeek-V3's bias rule, with DeepSeek-V4.1's two biases).

Every MoE layer *chooses* experts with ``gate.bias`` for text tokens and ``gate.bias_vl`` for image-span tokens
(delimiters included). One shared bias can look balanced over all tokens while one modality is badly
unbalanced, so each bias is moved only by the load of its own modality: after every optimizer step,

    bias_e += speed · sign(mean_load − load_e)

where ``load_e`` counts the tokens of that modality that chose expert ``e`` during the step (every micro-batch of
gradient accumulation, every process; padding excluded) and ``mean_load`` is its mean over experts. A modality
with no tokens in the step leaves its bias unchanged. A layer without ``bias_vl`` (a text-only model) routes every
token with ``bias``, so every token counts toward it.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist
from torch import nn

from processing.image_tokens import ImageTokenType

from ..modeling_dsv41 import DeepseekV41Model
from ..moe import DeepseekV41MoE
from ..padding import left_padding_shift, roll_rows

PADDING, TEXT, IMAGE = -1, 0, 1


def bias_update(load: torch.Tensor, speed: float) -> torch.Tensor:
    """``speed · sign(mean(load) − load)`` for one modality's per-expert token counts [E] (fp32);
    zeros when the modality had no tokens."""
    load = load.double()
    if not bool(load.sum() > 0):
        return torch.zeros_like(load, dtype=torch.float32)
    return (speed * torch.sign(load.mean() - load)).float()


def token_modalities(
    attention_mask: torch.Tensor | None, image_token_types: torch.Tensor | None, shape: tuple[int, int]
) -> torch.Tensor:
    """Per position [B, S]: ``PADDING`` (-1), ``TEXT`` (0) or ``IMAGE`` (1), in the order the MoE layers saw the
    tokens (the model moves the padding of left-padded rows to the end)."""
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be [B, S] = {list(shape)}, got {list(attention_mask.shape)}")
    if image_token_types is not None and tuple(image_token_types.shape) != tuple(shape):
        raise ValueError(f"image_token_types must be [B, S] = {list(shape)}, got {list(image_token_types.shape)}")
    device = next((t.device for t in (attention_mask, image_token_types) if t is not None), None)
    modality = torch.full(shape, TEXT, dtype=torch.long, device=device)
    if image_token_types is not None:
        modality = modality.masked_fill(image_token_types != ImageTokenType.TEXT.value, IMAGE)
    if attention_mask is not None:
        modality = modality.masked_fill(~attention_mask.bool(), PADDING)
        shift = left_padding_shift(attention_mask)
        if shift is not None:
            modality = roll_rows(modality, -shift)
    return modality


class RouterBiasBalancer:
    """Counts, per MoE layer and modality, which experts the tokens chose; :meth:`step` applies the rule.

    Counting needs no call: from construction on, every *training* forward pass of the model (the backbone in
    training mode with gradients enabled) adds its tokens' choices to the step's counts, read from each layer's
    ``last_expert_indices`` once the backbone's forward returns (so a gradient-checkpointing recomputation is not
    counted twice) with that call's ``attention_mask`` and ``image_token_types``. Evaluation, generation and
    reference forwards under ``torch.no_grad`` (DPO's reference log-probs, GRPO's rollouts) are not counted. Any
    training loop or ``Trainer`` subclass feeds it; call :meth:`step` after every optimizer step and
    :meth:`close` when done. Under ``torch.distributed`` the counts are summed over all processes first, so every
    replica moves its biases identically.

    Adapter training is refused: the biases belong to the frozen base model, which a saved adapter does not carry,
    so a balanced adapter would not reload as the model it trained.

    Example::

        balancer = RouterBiasBalancer(model, speed=1e-3)
        for batch in loader:
            model(**batch).loss.backward()
            optimizer.step(); optimizer.zero_grad()
            balancer.step()
        balancer.close()
    """

    def __init__(self, model: nn.Module, speed: float):
        if not speed >= 0:
            raise ValueError(f"the bias update speed must be >= 0, got {speed}")
        if is_adapter_model(model):
            raise ValueError(
                "router-bias balancing moves gate.bias / gate.bias_vl, which belong to the frozen base model and are "
                "not saved with an adapter: the adapter would not reload as the model it trained. Train adapters "
                "without balancing (DeepseekV41Trainer leaves the biases as loaded)"
            )
        # the backbone's routers (the DSpark draft blocks' have their own expert count and are not balanced here)
        self.moes = [
            module
            for name, module in model.named_modules()
            if isinstance(module, DeepseekV41MoE) and not re.search(r"(^|\.)mtp\.", name)
        ]
        backbones = [module for module in model.modules() if isinstance(module, DeepseekV41Model)]
        if not self.moes or not backbones:
            raise ValueError("the model has no DeepseekV41MoE layer: nothing to balance")
        self.speed = speed
        experts = self.moes[0].n_routed_experts
        device = self.moes[0].gate.bias.device
        self.counts = torch.zeros(len(self.moes), 2, experts, dtype=torch.long, device=device)  # [L, modality, E]
        self._hooks = [backbone.register_forward_hook(self._count_forward, with_kwargs=True) for backbone in backbones]

    def _count_forward(self, backbone: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """Forward hook of the backbone: count a training forward pass's expert choices."""
        if not (backbone.training and torch.is_grad_enabled()):
            return
        inputs = inspect.signature(backbone.forward).bind_partial(*args, **kwargs).arguments
        self.record(inputs.get("attention_mask"), inputs.get("image_token_types"))

    def record(
        self, attention_mask: torch.Tensor | None = None, image_token_types: torch.Tensor | None = None
    ) -> None:
        """Add the expert choices of the last forward pass ([B, S] masks of that batch) to this step's counts
        (training forward passes call it themselves)."""
        if any(moe.last_expert_indices is None for moe in self.moes):
            raise ValueError("record() needs a forward pass first: the MoE layers have no expert choices yet")
        shape = tuple(self.moes[0].last_expert_indices.shape[:2])
        modalities = token_modalities(attention_mask, image_token_types, shape)
        experts = self.counts.shape[-1]
        for layer, moe in enumerate(self.moes):
            indices = moe.last_expert_indices  # [B, S, k]
            modality = modalities.to(indices.device)
            if moe.gate.bias_vl is None:  # every token chose with `bias`
                modality = modality.clamp(max=TEXT)
            real = modality != PADDING
            keys = modality[real].unsqueeze(-1) * experts + indices[real]  # [N, k]: modality-major expert id
            self.counts[layer] += torch.bincount(keys.flatten(), minlength=2 * experts).view(2, experts)

    @torch.no_grad()
    def step(self) -> None:
        """Sum the counts over processes, move every bias by its own modality's load, start a new count.

        A step that counted no token at all is an error: the model ran no training forward pass since the last
        step (evaluation mode, gradients disabled, or another model), and balancing would silently do nothing."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.counts)
        if not bool(self.counts.any()):
            raise ValueError(
                "router-bias balancing counted no token in this optimizer step: the DeepSeek-V4.1 model must run its "
                "training forward passes in training mode with gradients enabled (model.train())"
            )
        for moe, counts in zip(self.moes, self.counts):
            gate = moe.gate
            gate.bias.add_(bias_update(counts[TEXT], self.speed).to(gate.bias.device, gate.bias.dtype))
            if gate.bias_vl is not None:
                gate.bias_vl.add_(bias_update(counts[IMAGE], self.speed).to(gate.bias_vl.device, gate.bias_vl.dtype))
        self.discard()

    def discard(self) -> None:
        """Drop this step's counts without moving any bias (an optimizer step skipped on gradient overflow)."""
        self.counts.zero_()

    def close(self) -> None:
        """Stop counting (removes the forward hooks); the biases stay where the steps moved them."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def is_adapter_model(model: nn.Module) -> bool:
    """Whether ``model`` trains PEFT adapters on a frozen base (a ``PeftModel``, or transformers' ``add_adapter``)."""
    return hasattr(model, "peft_config") or bool(getattr(model, "_hf_peft_config_loaded", False))


__all__ = ["RouterBiasBalancer", "bias_update", "is_adapter_model", "token_modalities"]
