"""The model inside a chunk's wrappers: one function, on its own so that the modules that build
chunks (``model.py``) and those that hook into them (``routing.py``) both reach it without
importing each other."""
from __future__ import annotations

from torch import nn


def unwrap(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "ragen_spec") and hasattr(chunk, "module"):
        chunk = chunk.module
    if not hasattr(chunk, "ragen_spec"):
        raise TypeError(f"{type(chunk).__name__} is not a chunk made by build_model")
    return chunk
