"""What DeepSeek-V4.1's pretrained class adds to transformers' loading, saving and distribution: the released storage
format and Engram table placement on load (:mod:`.loading`, :mod:`~modeling_dsv41.placement`), the released names
and flat remote code on save, our pipeline split (:mod:`~modeling_dsv41.pipeline`) and the experts-implementation
hooks. The model file mixes :class:`ReleasedCheckpointMixin` into its ``PreTrainedModel`` so it shows the
architecture only."""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from configuration.remote_code import (
    is_project_class,
    model_auto_map,
    pop_push_arguments,
    push_saved_folder,
    save_remote_code,
)

from ..pipeline import maybe_distribute_model
from ..placement import engram_device_map, hook_split_layers, place_loaded_engram_tables, requested_table_placement
from .conversions import NOT_LOADED_WITHOUT_DSPARK, in_our_layout
from .native_precision import DeepseekV41FP8Quantizer, saved_quantization_config
from .loading import finish_checkpoint_load, loads_natively, prepare_checkpoint_load, released_storage_loading
from .reading import hub_arguments

logger = logging.get_logger(__name__)


class ReleasedCheckpointMixin:
    """Loading, saving and distribution of a DeepSeek-V4.1 ``PreTrainedModel``; mixed in before it, so ``super()``
    is transformers' own."""

    def post_init(self) -> None:
        """The class's dtype and key lists, completed per instance: the fp32 modules this model has (the LM head, the
        ratio-2 compressors, which pool in fp32, the image-token router bias and the ViT norms, the draft head's
        heads), the draft head's keys ignored without it, and only the block classes it has as unsplittable."""
        text = self.config.get_text_config()
        extra = [
            f"layers.{spec.layer_id}.attn.compressor.{name}"
            for spec in text.layer_plan
            if spec.is_kv_source and spec.compress_ratio > 1
            for name in ("wkv", "wgate")
        ]
        if self.config.has_vision:
            extra += ["gate.bias_vl", "norm1", "norm2", "vision.norm"]
        if isinstance(getattr(self, "lm_head", None), nn.Module):
            extra.append("lm_head")
        if getattr(self, "mtp", None) is not None:  # the draft head's fp32 heads (its hc_*, sinks, gate biases above)
            extra += ["markov_head.head", "confidence_head.proj"]
        else:
            ignored = [*type(self)._keys_to_ignore_on_load_unexpected, NOT_LOADED_WITHOUT_DSPARK]
            self._keys_to_ignore_on_load_unexpected = ignored
        self._keep_in_fp32_modules_strict = [*type(self)._keep_in_fp32_modules_strict, *extra]
        # only the block classes this model has: accelerate's FSDP wraps by these names and refuses a missing one
        present = {type(module).__name__ for module in self.modules()}
        self._no_split_modules = [name for name in type(self)._no_split_modules if name in present]
        super().post_init()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args,
        engram_tables: Any = None,
        engram_tokenizer: Any = None,
        **kwargs,
    ):
        """:meth:`PreTrainedModel.from_pretrained`, which also reads DeepSeek's released storage format (FP8/FP4
        weights with E8M0 scales, kept as stored through the fine-grained FP8 quantization the folder implies, or
        dequantized to ``dtype`` on load with ``quantization_config=FineGrainedFP8Config(dequantize=True)``; FP8 Engram
        tables stay FP8 when the config says ``engram_table_dtype="fp8"``: see :mod:`.loading`), plus:

        Args:
            engram_tables: where the Engram tables live, whatever ``device_map`` does with the rest of the model:
                ``"auto"`` (the default with a planned ``device_map``), a device, ``"cpu"``, ``"pinned"`` or ``"mmap"``
                (see :func:`~modeling_dsv41.placement.requested_table_placement`). A planned ``device_map``
                (``"auto"``, ``"balanced"``, ...) is computed by :func:`~modeling_dsv41.placement.plan_device_map`
                (with the loaded dtypes), unless a ``quantization_config`` is given and ``engram_tables`` is not
                (transformers then plans with the quantizer's sizes).
            engram_tokenizer: the tokenizer (or path to its ``tokenizer.json``) to build the Engram compressed token
                map from. Needed only when the checkpoint has no ``engram_hasher.token_map`` (the released one) and
                no ``tokenizer.json`` sits next to the weights.

        With a :class:`~transformers.BitsAndBytesConfig`, the modules that must stay in high precision are added to
        its ``llm_int8_skip_modules``.
        """
        source, hub = pretrained_model_name_or_path, hub_arguments(kwargs)
        tables = requested_table_placement(engram_tables, kwargs, source)
        device_map_given = kwargs.get("device_map") is not None
        if tables is not None and device_map_given:
            native = lambda: loads_natively(source, kwargs, hub)  # noqa: E731  (only a planned map asks)
            kwargs["device_map"] = engram_device_map(cls, source, tables, kwargs, hub, native)
        released = prepare_checkpoint_load(cls, source, kwargs, hub)
        with released_storage_loading(cls.config_class.model_type) if released else nullcontext():
            loaded = super().from_pretrained(source, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        finish_checkpoint_load(model, source, engram_tokenizer, hub)
        if tables is not None:
            place_loaded_engram_tables(model, tables, device_map_given, source)
        hook_split_layers(model)
        return loaded

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args,
        save_original_format: bool | None = None,
        push_to_hub: bool = False,
        **kwargs,
    ) -> None:
        """:meth:`PreTrainedModel.save_pretrained`, plus the flat remote code the folder's ``auto_map`` names
        (:mod:`configuration.remote_code`), so that it loads with ``trust_remote_code=True`` where this package is
        not installed (Trainer checkpoints and ``push_to_hub`` save through here too).

        As transformers' models do, it writes the original checkpoint's names by default (root names, ``head``,
        per-expert ``w1``/``w2``/``w3``; plain weights), which ``from_pretrained`` reads back unchanged; a quantized
        model (native FP8/FP4, bitsandbytes) writes its quantizer's tensors under our names
        (``save_original_format=False``, the default there). :func:`~.writing.save_released_checkpoint` also
        quantizes as the release. A pipeline stage (``DistributedConfig(pp_size > 1)``) is refused: it holds only its
        own layers."""
        if getattr(self, "_pp_stage", None) is not None:
            raise ValueError(
                "this model is one pipeline stage (DistributedConfig(pp_size > 1)) and holds only its own layers: "
                "save the model loaded without pipeline parallelism"
            )
        quantized = getattr(self, "hf_quantizer", None) is not None
        if save_original_format is None:
            save_original_format = not quantized
        push = pop_push_arguments(save_directory, kwargs) if push_to_hub else None
        # a model built from a config that describes quantized storage (the release's) holds plain weights
        stored = None if quantized else self.config.__dict__.pop("quantization_config", None)
        native = isinstance(getattr(self, "hf_quantizer", None), DeepseekV41FP8Quantizer)
        loaded_quantization = self.config.quantization_config if native else None
        if native:  # modules merge_and_unload() made unquantized copies of load back as saved
            self.config.quantization_config = saved_quantization_config(self)
        try:
            super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)
        finally:
            if stored is not None:
                self.config.quantization_config = stored
            if native:
                self.config.quantization_config = loaded_quantization
        if not kwargs.get("is_main_process", True):
            return
        if is_project_class(type(self)):  # (remote code running as such is saved by transformers itself)
            save_remote_code(save_directory, {("config.json", None): model_auto_map(self)})
        if push is not None:
            push_saved_folder(save_directory, **push)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """:meth:`torch.nn.Module.load_state_dict`, taking a state dict in the released layout too (what
        ``save_pretrained`` writes by default, and what transformers' ``Trainer`` reads back this way to resume)."""
        return super().load_state_dict(in_our_layout(state_dict, set(self.state_dict())), strict, assign)

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict:
        """transformers' dtype plan, except FP8 Engram tables, kept as stored: a cast to the table's e4m3 dtype would
        round their E8M0 scales."""
        plan = super()._get_dtype_plan(dtype)
        if self.config.get_text_config().engram_table_dtype == "fp8":
            plan[r"engram\.embed\.weight"] = None
        return plan

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Log once, in words, the checkpoint weights this model ignores on purpose, then transformers' report."""
        ignored = re.compile("|".join(f"(?:{p})" for p in self._keys_to_ignore_on_load_unexpected or ()) or "(?!)")
        skipped = sorted(key for key in loading_info.unexpected_keys if ignored.search(key))
        if skipped:
            logger.warning(
                f"Ignoring {len(skipped)} checkpoint weights this model does not load (`image_pad`; the DSpark draft "
                f"head `mtp.*` when the config has none; draft blocks' copies of the shared embed / head), e.g. "
                f"{skipped[0]}"
            )
        super()._adjust_missing_and_unexpected_keys(loading_info)

    @classmethod
    def maybe_distribute_model(cls, model: nn.Module, distributed_config, mesh_manager) -> nn.Module:
        """transformers' TP/EP/FSDP; for ``pp_size > 1``, our own split of the stages (:mod:`..pipeline`)."""
        return maybe_distribute_model(super().maybe_distribute_model, model, distributed_config, mesh_manager)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """``eager`` unless asked otherwise: it is the reference's computation (routing weight before ``w2``, fp32 sum
        in expert order). ``batched_mm``/``grouped_mm`` agree with it to bf16 rounding (see DeepseekV41Experts)."""
        return super().get_correct_experts_implementation("eager" if requested_experts is None else requested_experts)

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None) -> str:
        """transformers' choice, also set on the text config: the experts read it there (the layers are built from
        it), and transformers sets it only at load time."""
        applicable = super()._check_and_adjust_experts_implementation(experts_implementation)
        self.config.get_text_config()._experts_implementation_internal = applicable
        return applicable

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True  # the routed experts (moe.py) use @use_experts_implementation
