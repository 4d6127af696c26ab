"""Our DeepSeek-V4 implementation (inference): config, native parameter table, model with cached decode."""

from engines.model.config import ModelConfig
from engines.model.decode_batch import DecodeBatch
from engines.model.model import DeepseekV4, SequenceCache

__all__ = ["DecodeBatch", "DeepseekV4", "ModelConfig", "SequenceCache"]
