"""Static-KV decoders for the supported HF families, and their loaders."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import KVCache, StaticKVDecoder
from .loading import LoadedModel, load_model, read_config, resolve_path

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "KVCache", "StaticKVDecoder", "LoadedModel", "load_model",
           "read_config", "resolve_path"]
