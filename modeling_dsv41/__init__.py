"""dsv41: DeepSeek-V4.1 for Hugging Face transformers.

Importing this package registers the configuration and model classes with the Auto classes (see :func:`register`).

The one exception is the ``dsv41`` command (the console script, or ``python -m modeling_dsv41.cli``): Python
imports this package before ``modeling_dsv41.cli``, and loading torch, transformers and the model takes seconds
(tens on a slow disk), so there the classes load on first use and each command that needs the registration calls
:func:`register` itself; ``dsv41 --help`` and argument errors answer at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

# names the package exports → the submodule defining them (loaded on first use in the `dsv41` command)
_EXPORTS = {
    "DeepseekV41Config": "configuration",
    "DeepseekV41TextConfig": "configuration",
    "DeepseekV41VisionConfig": "configuration",
    "DeepseekV41PreTrainedModel": "modeling_dsv41.modeling_dsv41",
    "DeepseekV41Model": "modeling_dsv41.modeling_dsv41",
    "DeepseekV41ForCausalLM": "modeling_dsv41.modeling_dsv41",
    "export_for_hub": "modeling_dsv41.hub.export",
    "push_to_hub": "modeling_dsv41.hub.export",
    # Trainer and accelerate are loaded on first use everywhere: inference and the exported model do not need them
    "DeepseekV41Trainer": "modeling_dsv41.training.trainer",
    "DeepseekV41TrainingArguments": "modeling_dsv41.training.trainer",
}

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Model",
    "DeepseekV41ForCausalLM",
    "export_for_hub",
    "push_to_hub",
    "register",
]


def register() -> None:
    """Map ``DeepseekV41Config`` (and its sub-configs) to the model classes in ``AutoConfig``, ``AutoModel``,
    ``AutoModelForCausalLM`` and ``AutoModelForImageTextToText`` (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from configuration import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

    from .modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Model

    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _imported_by_the_cli() -> bool:
    """Whether this import is the ``dsv41`` command's: its console script runs as ``…/bin/dsv41``, and while
    ``python -m modeling_dsv41.cli`` locates the module, ``sys.argv[0]`` is ``"-m"`` (a ``-m`` target elsewhere is
    located before it imports anything)."""
    argv = getattr(sys, "argv", None) or [""]
    return Path(argv[0]).name == "dsv41" or argv[0] == "-m"


if not _imported_by_the_cli():
    from configuration import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

    from .hub.export import export_for_hub, push_to_hub
    from .modeling_dsv41 import DeepseekV41ForCausalLM, DeepseekV41Model, DeepseekV41PreTrainedModel

    register()
