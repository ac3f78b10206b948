"""Loading the model to convert: a Hub id, a local folder or a `.gguf` file, and checking its family.

Supported: the Llama-family decoders whose blocks read `model.layers.i.self_attn.{q,k,v,o}_proj` (plus the
optional Qwen3 `q_norm`/`k_norm`), `mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`,
with `model.embed_tokens`, `model.norm`, `lm_head`, rotary positions and RMSNorm: `model_type` llama
(Llama 1-3, SmolLM/SmolLM2, TinyLlama, ...), mistral, qwen2 (Qwen2 and Qwen2.5) and qwen3.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

#: config attribute of a converted model recording where its source (the distillation teacher) loads from
SOURCE_ATTRIBUTE = "conversion_source"

#: `model_type` -> what it covers. Anything else is refused with this list.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama 1/2/3, SmolLM/SmolLM2, TinyLlama and other Llama-architecture checkpoints",
    "mistral": "Mistral (sliding-window attention kept as sliding_attention)",
    "qwen2": "Qwen2 and Qwen2.5 (q/k/v bias)",
    "qwen3": "Qwen3 dense (q/k RMSNorm)",
}

_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def supported_text() -> str:
    return "; ".join(f"{name} ({what})" for name, what in SUPPORTED_MODEL_TYPES.items())


@dataclasses.dataclass(frozen=True)
class SourceRef:
    """Where a source lives: `kind` is "gguf", "folder" or "hub"; `path` is a folder or Hub id."""

    spec: str
    kind: str
    path: str
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        """A short name for cards and logs (the Hub id, or the file/folder name)."""
        if self.kind == "hub":
            return self.path
        return self.gguf_file if self.kind == "gguf" else Path(self.path).name

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


@dataclasses.dataclass
class Source:
    """A loaded source: the model (eval mode), its tokenizer (or None) and generation config."""

    ref: SourceRef | None
    model: torch.nn.Module
    tokenizer: object | None = None

    @property
    def config(self):
        return self.model.config

    @property
    def name(self) -> str:
        if self.ref is not None:
            return self.ref.name
        return getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__


def resolve(spec: str | os.PathLike) -> SourceRef:
    """Classify SOURCE: an existing `.gguf` file, an existing folder, or else a Hub id.

    Raises `FileNotFoundError` for a path that does not exist (a `.gguf` name, or anything that looks like
    a path rather than `org/name`).
    """
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {text}")
        return SourceRef(text, "gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{text} is a folder without config.json: not a Transformers checkpoint")
        return SourceRef(text, "folder", str(path.resolve()))
    if path.exists():
        raise FileNotFoundError(f"{text} is a file but not a .gguf file; give a folder, a .gguf file or a Hub id")
    if not looks_like_hub_id(text):
        raise FileNotFoundError(f"source not found: {text} (no such folder or .gguf file)")
    return SourceRef(text, "hub", text)


def looks_like_hub_id(text: str) -> bool:
    """Whether `text` (not an existing path) could be a Hub repo id: `name` or `owner/name`."""
    return (
        not text.startswith((".", "/", "~"))
        and text.count("/") <= 1
        and "\\" not in text
        and all(part and part[0].isalnum() for part in text.split("/"))
    )


def _hub_error(ref: SourceRef, error: Exception) -> FileNotFoundError:
    return FileNotFoundError(
        f"could not load {ref.spec!r}: it is not a local folder or .gguf file, and loading it as a Hub id "
        f"failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    )


def load_config(ref: SourceRef):
    """The source's Transformers config, without loading weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(ref.path, **ref.from_pretrained_kwargs())
    except (OSError, ValueError) as error:
        if ref.kind == "hub":
            raise _hub_error(ref, error) from None
        if "model_type" in str(error) or "Unrecognized" in str(error) or "not supported" in str(error):
            raise ValueError(f"unsupported architecture in {ref.spec}: {error}. Supported: {supported_text()}") from None
        what = "config.json" if ref.kind == "folder" else "GGUF metadata"
        raise ValueError(f"{ref.spec}: its {what} could not be read ({_first_line(error)}); "
                         "the file is damaged or incomplete: download or save the model again") from None


def check_supported(config) -> None:
    """Raise `ValueError` naming what is supported when `config` is not a supported family."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "unknown class"
        raise ValueError(
            f"unsupported architecture {model_type!r} ({architectures}); supported model types: {supported_text()}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"encoder-decoder models are not supported; supported: {supported_text()}")


def check_layout(model: torch.nn.Module) -> None:
    """Raise `ValueError` when the module tree is not the Llama layout the weight mapping expects."""
    inner = getattr(model, "model", None)
    problems = []
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        problems.append("model.{embed_tokens,layers,norm}")
    elif getattr(model, "lm_head", None) is None:
        problems.append("lm_head")
    else:
        for i, layer in enumerate(inner.layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            missing = [f"self_attn.{n}" for n in _ATTENTION_MODULES if not isinstance(getattr(attn, n, None), torch.nn.Linear)]
            missing += [f"mlp.{n}" for n in _MLP_MODULES if not isinstance(getattr(mlp, n, None), torch.nn.Linear)]
            missing += [n for n in ("input_layernorm", "post_attention_layernorm") if not hasattr(layer, n)]
            if missing:
                problems.append(f"layer {i}: {', '.join(missing)}")
                break
    if problems:
        raise ValueError(
            f"{type(model).__name__} does not have the Llama module layout the conversion maps "
            f"(missing {problems[0]}); supported: {supported_text()}"
        )


def load_source(spec, dtype: str | torch.dtype = "auto", with_tokenizer: bool = True) -> Source:
    """Load SOURCE (Hub id, folder or `.gguf` file) for conversion; checks family and layout first.

    GGUF files are de-quantized to float32 by Transformers (the `gguf` package); their tokenizer is read
    from the same file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = spec if isinstance(spec, SourceRef) else resolve(spec)
    config = load_config(ref)
    check_supported(config)
    kwargs = ref.from_pretrained_kwargs()
    try:
        model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=dtype, **kwargs)
    except Exception as error:  # noqa: BLE001  (safetensors, json and gguf readers raise their own types)
        if ref.kind == "hub" and isinstance(error, OSError):
            raise _hub_error(ref, error) from None
        if isinstance(error, (OSError, ValueError, RuntimeError)) or "Safetensor" in type(error).__name__:
            raise ValueError(f"{ref.spec}: the weights could not be loaded ({type(error).__name__}: "
                             f"{_first_line(error)}); the weight files are damaged or incomplete: download or save "
                             "the model again") from None
        raise
    model.eval()
    check_layout(model)
    tokenizer = None
    if with_tokenizer and (ref.kind != "folder" or _has_tokenizer_files(Path(ref.path))):
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref.path, **kwargs)
        except Exception as error:  # noqa: BLE001  (tokenizers raise their own exception types)
            raise ValueError(
                f"{ref.spec}: its tokenizer could not be loaded ({type(error).__name__}: {_first_line(error)}). "
                "Repair or remove the tokenizer files, or pass --no_tokenizer to convert without one (calibration "
                "then uses random token ids and no tokenizer is saved)"
            ) from None
    return Source(ref, model, tokenizer)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def source_layer_types(config) -> list[str]:
    """The attention kind of every source layer: "full_attention" or "sliding_attention"."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [t if t in ("full_attention", "sliding_attention") else "full_attention" for t in types]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


__all__ = [
    "SOURCE_ATTRIBUTE",
    "SUPPORTED_MODEL_TYPES",
    "Source",
    "SourceRef",
    "check_layout",
    "check_supported",
    "load_config",
    "load_source",
    "resolve",
    "source_layer_types",
    "supported_text",
]
