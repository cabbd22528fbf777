"""Moved to :mod:`modeling_dsv41.generation.cache`; this name stays importable for existing code."""

from .generation.cache import *  # noqa: F401,F403
from .generation.cache import __all__  # noqa: F401
