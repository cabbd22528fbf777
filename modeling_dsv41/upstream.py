"""Where we meet the private parts of transformers, PEFT, TRL and accelerate: every private name this project relies
on, one list per library, with the versions it was checked against.

A model that plugs into ``generate``, ``from_pretrained``'s conversions and quantizers, the ``Trainer`` and PEFT's
dispatch has to override or read some of their underscored methods and attributes, which may move in any release.
Private *names we import* are imported from here (so each has one import site); the private *methods we override*
and the *attributes we read* are listed here. ``tests/test_upstream.py`` checks the installed versions against the
lists: that every listed name still exists (a method still takes the parameters our override takes and passes), and
that every private method our classes override, or private name they import, is listed. Its failure names the private
API and the installed version. ``setup.cfg`` bounds each library to the versions below.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.distributed.parallel_utils import _get_parameter_plan
from transformers.integrations.moe import _grouped_mm


@dataclass(frozen=True)
class Library:
    """A library's private names we rely on (dotted paths from the package root), and the versions they were checked
    against (the oldest and the newest CI installs)."""

    name: str
    checked: tuple[str, ...]
    overridden: tuple[str, ...] = ()  # private methods and class attributes our subclasses override
    imported: tuple[str, ...] = ()  # private names imported (from this module)
    read: tuple[tuple[str, str], ...] = ()  # (module, attribute): a private attribute we read or set on its objects


TRANSFORMERS = Library(
    "transformers",
    checked=("5.24.0", "5.25.0"),
    overridden=(
        "transformers.distributed.mixin.DistributedMixin._pp_plan",
        "transformers.distributed.mixin.DistributedMixin._tp_plan",
        "transformers.generation.utils.GenerationMixin._assisted_decoding",
        "transformers.generation.utils.GenerationMixin._expand_inputs_for_generation",
        "transformers.generation.utils.GenerationMixin._prepare_cache_for_generation",
        "transformers.generation.utils.GenerationMixin._prepare_generation_config",
        "transformers.generation.utils.GenerationMixin._supports_default_dynamic_cache",
        "transformers.generation.utils.GenerationMixin._validate_generated_length",
        "transformers.generation.utils.GenerationMixin._validate_generation_mode",
        "transformers.image_processing_utils.BaseImageProcessor._preprocess_image_like_inputs",
        "transformers.image_processing_utils.BaseImageProcessor._validate_preprocess_kwargs",
        "transformers.modeling_utils.PreTrainedModel._adjust_missing_and_unexpected_keys",
        "transformers.modeling_utils.PreTrainedModel._can_record_outputs",
        "transformers.modeling_utils.PreTrainedModel._can_set_attn_implementation",
        "transformers.modeling_utils.PreTrainedModel._can_set_experts_implementation",
        "transformers.modeling_utils.PreTrainedModel._check_and_adjust_experts_implementation",
        "transformers.modeling_utils.PreTrainedModel._get_dtype_plan",
        "transformers.modeling_utils.PreTrainedModel._init_weights",
        "transformers.modeling_utils.PreTrainedModel._keep_in_fp32_modules_strict",
        "transformers.modeling_utils.PreTrainedModel._keys_to_ignore_on_load_missing",
        "transformers.modeling_utils.PreTrainedModel._keys_to_ignore_on_load_unexpected",
        "transformers.modeling_utils.PreTrainedModel._no_split_modules",
        "transformers.modeling_utils.PreTrainedModel._supports_flash_attn",
        "transformers.modeling_utils.PreTrainedModel._supports_sdpa",
        "transformers.modeling_utils.PreTrainedModel._tied_weights_keys",
        "transformers.processing_utils.ProcessorMixin._process_images",
        "transformers.quantizers.quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer._process_model_after_weight_loading",
        "transformers.quantizers.quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer._process_model_before_weight_loading",
        "transformers.trainer.Trainer._build_accelerator_args",
        "transformers.trainer.Trainer._clip_grad_norm",
        "transformers.trainer.Trainer._get_output_dir",
        "transformers.trainer.Trainer._prepare_for_training",
        "transformers.trainer.Trainer._save_checkpoint",
        "transformers.training_args.TrainingArguments._VALID_DICT_FIELDS",
    ),
    imported=(
        "transformers.distributed.parallel_utils._get_parameter_plan",  # which plan rule a parameter falls under
        "transformers.integrations.moe._grouped_mm",  # torch's grouped GEMM where it runs, else a custom op
    ),
    read=(
        ("transformers.core_model_loading", "_weight_conversions"),  # the conversions a load used, reversed by a save
        ("transformers.modeling_layers", "_gradient_checkpointing_func"),  # wrapped to offload checkpointed inputs
        ("transformers.generation.utils", "_valid_auto_compile_criteria"),  # DSpark's steps compile as generate's
        ("transformers.generation.configuration_utils", "_pad_token_tensor"),
        ("transformers.configuration_utils", "_experts_implementation"),
    ),
)
PEFT = Library(
    "peft",
    checked=("0.21.0", "0.21.2"),
    overridden=("peft.tuners.lora.layer.ParamWrapper._get_in_out_features",),
    read=(("peft.tuners.lora.model", "_create_new_module"),),  # wrapped: our dispatch for the released precision
)
TRL = Library("trl", checked=("1.16.0",))
ACCELERATE = Library("accelerate", checked=("1.15.0", "1.16.0"))

LIBRARIES = (TRANSFORMERS, PEFT, TRL, ACCELERATE)

__all__ = ["LIBRARIES", "Library", "_get_parameter_plan", "_grouped_mm"]
