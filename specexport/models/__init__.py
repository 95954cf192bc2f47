"""Static-KV decoders for the supported HF families, and their loaders.

The names load lazily (PEP 562): `specexport.models.config` (ModelConfig) stays importable without torch, for
the lean ONNX runtime; the decoder and the loaders import torch when first used.
"""

from __future__ import annotations

import importlib

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "KVCache", "StaticKVDecoder", "LoadedModel", "load_model",
           "read_config", "resolve_path"]
_WHERE = {"SUPPORTED_MODEL_TYPES": "config", "ModelConfig": "config", "KVCache": "decoder",
          "StaticKVDecoder": "decoder", "LoadedModel": "loading", "load_model": "loading", "read_config": "loading",
          "resolve_path": "loading"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
