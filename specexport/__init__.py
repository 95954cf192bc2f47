"""specexport: lossless speculative decoding over static KV buffers."""

from .config import DecoderConfig, SamplingParams
from .errors import SpecExportError
from .runtime import GenerationOutput, GenerationStats, SpeculativeDecoder, StreamEvent
from .version import __version__

__all__ = ["SpeculativeDecoder", "SamplingParams", "DecoderConfig", "SpecExportError", "GenerationOutput",
           "GenerationStats", "StreamEvent", "__version__"]
