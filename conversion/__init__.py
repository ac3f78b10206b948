"""Converting, distilling, fine-tuning, evaluating and publishing delta-attention models.

One sub-package per job: `converter/` (convert a checkpoint), `data/` (assets, text and chat data),
`training/` (the loop, distill, finetune), `evaluation/` (measures and the report), `publishing/` (cards,
push). The modules at this level serve them all: `output_folder` (where a command may write), `saving`
(atomic folder saves), `loading` (a model for a job), `memory` (cache and state bytes), `precision`.
"""

import importlib

from .converter.pipeline import ConversionResult, ConversionSettings, convert, convert_model, save_converted

# public names -> defining module, imported on first use (keeps `import delta_attention.conversion.x` light)
_EXPORTS = {
    "load_source": "converter.sources",
    "SUPPORTED_MODEL_TYPES": "converter.sources",
    "fetch_assets": "data.assets",
    "smollm2_gguf_path": "data.assets",
    "train_texts": "data.assets",
    "heldout_texts": "data.assets",
    "token_windows": "data.windows",
    "perplexity": "evaluation.perplexity",
    "collect_teacher_activations": "converter.attention_transfer",
    "fit_layer": "converter.attention_transfer",
    "load_model": "loading",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted([*_EXPORTS, "ConversionResult", "ConversionSettings", "convert", "convert_model", "save_converted"])
