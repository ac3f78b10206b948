"""Model code of delta-attention; these files also ship inside every saved checkpoint."""

from .cache_io import StateMismatchError, load_cache, save_cache, state_file_info
from .configuration_delta import DeltaConfig
from .delta_cache import DeltaCache
from .delta_rule import chunk_delta_rule, delta_rule_reference, recurrent_delta_rule
from .modeling_delta import DeltaForCausalLM, DeltaModel, DeltaPreTrainedModel

__all__ = [
    "DeltaCache",
    "DeltaConfig",
    "DeltaForCausalLM",
    "DeltaModel",
    "DeltaPreTrainedModel",
    "StateMismatchError",
    "chunk_delta_rule",
    "delta_rule_reference",
    "load_cache",
    "recurrent_delta_rule",
    "save_cache",
    "state_file_info",
]
