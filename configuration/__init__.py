"""Configuration classes for DeepSeek-V4.1 (text backbone, DeepSeek-ViT, and the composite config)."""

from .configuration_dsv41 import PRESETS_DIR, DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

__all__ = ["DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig", "PRESETS_DIR"]
