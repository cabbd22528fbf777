"""What a checkpoint holds, read before ``from_pretrained`` loads it: its files (local or on the Hub), whether it is
in the released storage format (``.scale`` tensors) and whether its Linears and experts are stored quantized.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open
from transformers.utils import cached_file

_SCALE = ".scale"


# the `from_pretrained` keyword arguments that say where a checkpoint's files come from
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def hub_arguments(kwargs: dict) -> dict:
    """The :data:`HUB_KWARGS` among ``from_pretrained``'s keyword arguments."""
    return {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}


def checkpoint_file(source: str | os.PathLike | None, filename: str, hub_kwargs: dict) -> str | None:
    """The local path of ``filename`` of the checkpoint at ``source`` (a folder or a Hub repo), or None."""
    if source is None:  # from_pretrained(None, state_dict=...)
        return None
    return cached_file(
        str(source),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub_kwargs,
    )


def _stored_keys(source: str | os.PathLike, hub_kwargs: dict) -> list[str]:
    index = checkpoint_file(source, "model.safetensors.index.json", hub_kwargs)
    if index is not None:
        return list(json.loads(Path(index).read_text())["weight_map"])
    single = checkpoint_file(source, "model.safetensors", hub_kwargs)
    if single is None:
        return []
    with safe_open(single, framework="pt") as f:
        return list(f.keys())


def stores_scales(source: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether the safetensors checkpoint at ``source`` holds ``.scale`` tensors (the released storage format)."""
    return any(key.endswith(_SCALE) for key in _stored_keys(source, hub_kwargs))


def stores_released_names(source: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether ``source`` names its tensors as the release does (the backbone at the root, ``head``): the released
    storage, or plain weights ``save_pretrained`` wrote in the original layout."""
    return any(re.match(r"(embed|layers|head)\.", key) for key in _stored_keys(source, hub_kwargs))


def stores_quantized_weights(source: str | os.PathLike, **hub_kwargs) -> bool:
    """Whether ``source`` stores Linears or experts quantized (FP8 / FP4 with scales), not only FP8 Engram tables:
    the checkpoints that load natively (:mod:`.native_precision`)."""
    return any(
        key.endswith(_SCALE) and not key.endswith("engram.embed.scale") for key in _stored_keys(source, hub_kwargs)
    )


@contextmanager
def sequential_loading():
    """Have transformers read each checkpoint tensor only when its parameter is converted.

    By default a thread pool materializes every tensor ahead of conversion, cast to the load dtype. Converted
    tensors then wait their turn in that inflated form (an FP4 byte becomes four bf16 bytes), which can add most of
    the model's size to the peak. ``HF_DEACTIVATE_ASYNC_LOAD`` is transformers' switch for sequential loading.
    """
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


__all__ = [
    "HUB_KWARGS",
    "checkpoint_file",
    "hub_arguments",
    "sequential_loading",
    "stores_quantized_weights",
    "stores_released_names",
    "stores_scales",
]
