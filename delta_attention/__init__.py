"""delta-attention: delta-rule linear attention for Hugging Face Transformers.

Importing the package registers `DeltaConfig`, `DeltaModel` and `DeltaForCausalLM` with the Auto classes.
`DeltaCache` is the cache those models create (a `DynamicCache` whose delta layers count their tokens).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling import (
    DeltaCache,
    DeltaConfig,
    DeltaForCausalLM,
    DeltaModel,
    DeltaPreTrainedModel,
    chunk_delta_rule,
    delta_rule_reference,
    recurrent_delta_rule,
)

__version__ = "0.1.0"

AutoConfig.register(DeltaConfig.model_type, DeltaConfig, exist_ok=True)
AutoModel.register(DeltaConfig, DeltaModel, exist_ok=True)
AutoModelForCausalLM.register(DeltaConfig, DeltaForCausalLM, exist_ok=True)

__all__ = [
    "DeltaCache",
    "DeltaConfig",
    "DeltaForCausalLM",
    "DeltaModel",
    "DeltaPreTrainedModel",
    "__version__",
    "chunk_delta_rule",
    "delta_rule_reference",
    "recurrent_delta_rule",
]
