"""Loading a model for a job (`distill`, `finetune`, `evaluate`, the demo): one place for the checks and errors.

`load_model` takes a model folder, a Hub id or a `.gguf` file and returns the model (eval mode) and its
tokenizer, turning what goes wrong into one clear error: no such folder, damaged `config.json` or weights,
a model that is not a delta model where one is needed, a tokenizer that does not load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from delta_attention.modeling.configuration_delta import delta_layer_indices

from .converter.sources import _first_line, looks_like_hub_id


def check_model_spec(spec, what: str = "model") -> None:
    """Fail early (before anything is loaded) when `spec` names a local folder that does not exist."""
    if not spec:
        raise ValueError(f"give the {what}: a model folder or Hub id")
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"{what} {text}: no such .gguf file")
        return
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{what} {text} is a file; give a model folder, a .gguf file or a Hub id")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{what} {text} is a folder without config.json: not a saved model")
        return
    if "/" not in text or not looks_like_hub_id(text):
        raise FileNotFoundError(f"{what} {text}: no such model folder (and not a Hub id of the form owner/name)")


def load_model(spec, *, dtype: torch.dtype = torch.float32, require_delta: bool = False, tokenizer: bool = True,
               what: str = "model"):
    """`(model, tokenizer)` from a folder, Hub id or `.gguf` file; `tokenizer` None when it is not asked for.

    With `require_delta`, a model that is not a delta-attention model (or has no delta layer) is an error.
    """
    import delta_attention  # noqa: F401  (registers the Auto classes)

    check_model_spec(spec, what)
    text = os.fspath(spec)
    if text.lower().endswith(".gguf"):
        from .converter.sources import load_source

        source = load_source(text, dtype=dtype, with_tokenizer=tokenizer)
        return source.model.eval(), source.tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(text, dtype=dtype)
    except Exception as error:  # noqa: BLE001  (json, safetensors and hub clients raise their own types)
        if isinstance(error, (OSError, ValueError, RuntimeError, KeyError)) or "Safetensor" in type(error).__name__:
            raise ValueError(f"{what} {text} could not be loaded ({type(error).__name__}: {_first_line(error)}); "
                             "its files may be damaged or incomplete: save or download it again") from None
        raise
    model.eval()
    if require_delta:
        if getattr(model.config, "model_type", None) != "delta":
            raise ValueError(f"{what} {text} holds a {model.config.model_type!r} model; a converted delta-attention "
                             "model is needed (run `delta-attention convert` first)")
        if not delta_layer_indices(model.config.layer_types):
            raise ValueError(f"{what} {text} has no delta layers (every layer is softmax attention)")
    loaded_tokenizer = None
    if tokenizer:
        try:
            loaded_tokenizer = AutoTokenizer.from_pretrained(text)
        except Exception as error:  # noqa: BLE001  (tokenizers raise their own types)
            raise ValueError(f"{what} {text}: its tokenizer could not be loaded ({type(error).__name__}: "
                             f"{_first_line(error)}); save the tokenizer into the folder "
                             "(`tokenizer.save_pretrained`) or repair it") from None
    return model, loaded_tokenizer


__all__ = ["check_model_spec", "load_model"]
