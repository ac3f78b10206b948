"""Converting, distilling, fine-tuning and publishing delta-attention models."""

import importlib

# `convert` is both a submodule and the function; import it now so the package attribute is the function
from .convert import ConversionResult, ConversionSettings, convert, convert_model, save_converted  # noqa: E402

# public names -> defining module, imported on first use (keeps `import delta_attention.conversion.x` light)
_EXPORTS = {
    "load_source": "sources",
    "SUPPORTED_MODEL_TYPES": "sources",
    "fetch_assets": "assets",
    "smollm2_gguf_path": "assets",
    "train_texts": "assets",
    "heldout_texts": "assets",
    "token_windows": "text_windows",
    "perplexity": "text_windows",
    "collect_teacher_activations": "attention_transfer",
    "fit_layer": "attention_transfer",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted([*_EXPORTS, "ConversionResult", "ConversionSettings", "convert", "convert_model", "save_converted"])
