"""specexport: lossless speculative decoding over static KV buffers."""

from .config import DecoderConfig, SamplingParams
from .errors import SpecExportError
from .runtime import GenerationOutput, GenerationStats, SpeculativeDecoder, StreamEvent

__version__ = "0.1.0"

__all__ = ["SpeculativeDecoder", "SamplingParams", "DecoderConfig", "SpecExportError", "GenerationOutput",
           "GenerationStats", "StreamEvent", "__version__"]
