"""delta-attention: delta-rule linear attention for Hugging Face Transformers.

Importing the package registers `DeltaConfig`, `DeltaModel` and `DeltaForCausalLM` with the Auto classes.
`DeltaCache` is the cache those models create (a `DynamicCache` whose delta layers count their tokens).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import modeling
from .modeling import *  # noqa: F403  (the public model API: config, models, cache, kernels)
from .modeling import DeltaConfig, DeltaForCausalLM, DeltaModel

__version__ = "0.1.0"

AutoConfig.register(DeltaConfig.model_type, DeltaConfig, exist_ok=True)
AutoModel.register(DeltaConfig, DeltaModel, exist_ok=True)
AutoModelForCausalLM.register(DeltaConfig, DeltaForCausalLM, exist_ok=True)

__all__ = ["__version__", *modeling.__all__]
