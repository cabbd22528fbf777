"""Registering our quantizer with transformers once per process, whichever copy of the code comes first.

The package and the remote code ``export_for_hub`` ships are two copies of the same modules: one process may import
both (a folder loaded with ``trust_remote_code=True`` before ``import modeling_dsv41``, or after), and transformers'
``register_quantization_config`` / ``register_quantizer`` refuse a second registration of a name. Here a copy of the
same class (same module file name and class name) is no conflict: the installed package's class takes the name, as
its model classes take precedence over a repo's code, and a remote copy never displaces a registered class. A
different class under our name is still refused.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

_PACKAGE = "modeling_dsv41."


def _is_copy_of(registered: type, cls: type) -> bool:
    """Whether ``registered`` is ``cls`` or the same class of another copy of the code (package vs remote)."""
    same_file = registered.__module__.rsplit(".", 1)[-1] == cls.__module__.rsplit(".", 1)[-1]
    return registered is cls or (same_file and registered.__qualname__ == cls.__qualname__)


def _register_in(mapping: dict[str, type], kind: str, name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        registered = mapping.get(name)
        if registered is not None and not _is_copy_of(registered, cls):
            raise ValueError(
                f"{kind} {name!r} is already registered as {registered.__module__}.{registered.__qualname__}"
            )
        if registered is None or cls.__module__.startswith(_PACKAGE):
            mapping[name] = cls
        return cls

    return register


def register_quantization_config(method: str) -> Callable[[type], type]:
    """``transformers.quantizers.register_quantization_config``, tolerating another copy of the same class."""
    return _register_in(AUTO_QUANTIZATION_CONFIG_MAPPING, "quantization config", method)


def register_quantizer(name: str) -> Callable[[type], type]:
    """``transformers.quantizers.register_quantizer``, tolerating another copy of the same class."""
    return _register_in(AUTO_QUANTIZER_MAPPING, "quantizer", name)


__all__ = ["register_quantization_config", "register_quantizer"]
