"""dsv41: DeepSeek-V4.1 for Hugging Face transformers.

Importing this package registers the configuration and model classes with the Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from configuration import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

from .modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Model, DeepseekV41PreTrainedModel
from .export import export_for_hub, push_to_hub  # noqa: F401  (Hub publishing with remote code)


def _register() -> None:
    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)


_register()

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Model",
    "DeepseekV41ForCausalLM",
]


def __getattr__(name: str):
    """``DeepseekV41Trainer`` / ``DeepseekV41TrainingArguments`` load on first use: they import transformers'
    Trainer and accelerate, which inference and the exported model do not need."""
    if name in ("DeepseekV41Trainer", "DeepseekV41TrainingArguments"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
