"""DeepSeek-V4.1 preprocessing: image processors (torch and PIL backends), the processor, a tiny local tokenizer.

Importing this package registers the classes with ``AutoImageProcessor`` and ``AutoProcessor`` for
``model_type="deepseek_v41"`` (see :func:`register`).
"""

from .image_processing_dsv41 import DeepseekV41ImageProcessor, ImageGridPlan, plan_image_grid
from .image_processing_pil_dsv41 import DeepseekV41ImageProcessorPil
from .image_tokens import ImageTokenType, image_span_token_types, span_length, token_grid
from .processing_dsv41 import DeepseekV41Processor
from .tokenizer_dsv41 import CHAT_TEMPLATE, IMAGE_TOKEN, build_tiny_tokenizer


def register() -> None:
    """Map ``DeepseekV41Config`` to these classes in ``AutoImageProcessor`` and ``AutoProcessor`` (idempotent).

    The torch backend sits under transformers' tensor-backend key ``"torchvision"`` although it needs only torch:
    auto-selection then follows transformers' rule (tensor backend when torchvision is installed, else PIL), and
    ``backend="torchvision"`` asks for it explicitly. Both backends give identical outputs.
    """
    from transformers import AutoImageProcessor, AutoProcessor

    from configuration.configuration_dsv41 import DeepseekV41Config

    AutoImageProcessor.register(
        DeepseekV41Config,
        image_processor_classes={"torchvision": DeepseekV41ImageProcessor, "pil": DeepseekV41ImageProcessorPil},
        exist_ok=True,
    )
    AutoProcessor.register(DeepseekV41Config, DeepseekV41Processor, exist_ok=True)


register()

__all__ = [
    "CHAT_TEMPLATE",
    "DeepseekV41ImageProcessor",
    "DeepseekV41ImageProcessorPil",
    "DeepseekV41Processor",
    "IMAGE_TOKEN",
    "ImageGridPlan",
    "ImageTokenType",
    "build_tiny_tokenizer",
    "image_span_token_types",
    "plan_image_grid",
    "register",
    "span_length",
    "token_grid",
]
