"""Converting a Llama/Mistral/Qwen checkpoint to delta attention: plan, build, initialise, save.

    from delta_attention.conversion import convert, ConversionSettings
    result = convert("model.gguf", "out/", ConversionSettings(keep_attention="0.25", init="calibrated"))

Every check that can fail on user input (output folder, source, family, `--keep-attention`, options) runs
before anything is loaded or written. The output folder is written under a hidden temporary name next to
it and renamed into place at the end, so an interrupted conversion never leaves a folder that looks
complete.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from delta_attention.modeling import DeltaForCausalLM
from delta_attention.modeling.configuration_delta import DELTA_GATES, DELTA_LAYER

from . import init_recipes as I
from .weight_mapping import copy_delta_projections, copy_shared_weights
from .attention_transfer import collect_teacher_activations
from .calibration import LayerCalibration, calibrate_layer
from .induction import induction_layers, induction_scores, repeated_sequences
from .layer_plan import KeepSpec, LayerPlan, check_window, choose_auto, copy_slots, make_plan, parse_keep
from ..memory import MemoryReport, count_parameters, memory_report
from ..output_folder import check_output_folder
from ..saving import atomic_save
from .sources import SOURCE_ATTRIBUTE, Source, SourceRef, check_layout, check_supported, load_config, load_source, resolve, source_layer_types
from .target_config import DeltaOptions, delta_config_from_source
from ..data.windows import random_windows, token_windows
from ..evaluation.perplexity import mean_nll

INITS = ("copy", "calibrated")
#: how an auto plan ranks layers: by the cost of bypassing each one's attention, or of converting it alone
RANKINGS = ("bypass", "conversion")
#: the induction probe of auto plans: this many random sequences of this many tokens, each repeated once
INDUCTION_PROBE_LENGTH, INDUCTION_PROBE_COUNT = 128, 4
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass
class ConversionSettings:
    """Everything a conversion chooses; `delta-attention convert` reads these fields as its flags."""

    keep_attention: str = dataclasses.field(
        default="auto:0.25",
        metadata={"help": "layers that stay softmax: all | none | 0,4,8 | a ratio like 0.25 (uniform from layer 0) | "
                          "auto:<ratio> (layer 0, the layers with induction heads, then the layers whose conversion "
                          "costs most perplexity; --rank_by)"},
    )
    induction_share: float = dataclasses.field(
        default=0.5, metadata={"help": "auto: at most this share of the kept layers goes first to the layers with "
                                       "induction (copying) heads, strongest first; 0: rank by --rank_by alone"}
    )
    rank_by: str = dataclasses.field(
        default="conversion", metadata={"help": "auto: how the layers after layer 0 and the induction layers are "
                                                "ranked: conversion (perplexity with the layer alone replaced by its "
                                                "calibrated delta layer: what converting it costs; calibrates every "
                                                "layer, kept ones too) | bypass (perplexity with the layer's "
                                                "attention replaced by zeros; the default before)"}
    )
    keep_first_layer: bool = dataclasses.field(
        default=True, metadata={"help": "auto: always keep layer 0 as softmax (--no_keep_first_layer to rank it too)"}
    )
    gate: str = dataclasses.field(
        default="channel",
        metadata={"help": "delta decay: channel (KDA, one decay per key channel; the default) | scalar (Gated "
                          "DeltaNet, one per head) | none (DeltaNet)"},
    )
    init: str = dataclasses.field(
        default="calibrated",
        metadata={"help": "copy (weights copied, fixed defaults) | calibrated (fitted to the source's attention)"},
    )
    conv_kernel_size: int = dataclasses.field(default=4, metadata={"help": "short conv kernel of delta layers (0 = off)"})
    output_gate: bool = dataclasses.field(default=True, metadata={"help": "delta output gate (--no_output_gate: off)"})
    allow_neg_eigval: bool = dataclasses.field(default=False, metadata={"help": "beta in (0, 2) instead of (0, 1)"})
    chunk_size: int = dataclasses.field(default=64, metadata={"help": "chunk length of the chunked kernel"})
    gqa_state: bool = dataclasses.field(
        default=False,
        metadata={"help": "one delta state per KV head, read by its group of query heads (k/v projections taken as "
                          "they are, beta and decay per KV head): the state memory shrinks by heads / KV heads (3x for "
                          "SmolLM2). Default: one state per query head (k/v repeated over each group)"},
    )
    calibration_tokens: int = dataclasses.field(default=4096, metadata={"help": "tokens of calibration text"})
    calibration_seq_len: int = dataclasses.field(default=512, metadata={"help": "length of a calibration window"})
    calibration_steps: int = dataclasses.field(
        default=0, metadata={"help": "calibrated init: Adam steps per delta layer on the teacher's attention output"}
    )
    calibration_lr: float = dataclasses.field(default=3e-3, metadata={"help": "learning rate of those steps"})
    search_windows: int = dataclasses.field(
        default=2, metadata={"help": "calibrated init: windows used to search each head's (beta, decay)"}
    )
    rank_tokens: int = dataclasses.field(default=2048, metadata={"help": "auto: tokens of text to rank layers on"})
    bf16: bool = dataclasses.field(default=True, metadata={
        "help": "bf16 autocast for calibration and ranking, where the CPU multiplies bf16 natively (AMX, AVX512-BF16; "
                "float32 elsewhere)"})
    dtype: str = dataclasses.field(
        default="auto", metadata={"help": "saved weights: auto (source dtype) | float32 | bfloat16 | float16"}
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the new parameters' random parts"})
    attention_window: int | None = dataclasses.field(
        default=None,
        metadata={"help": "turn every kept softmax layer into a sliding-window layer over its last W tokens, so the "
                          "cache is bounded at any length (delta states + W keys/values per kept layer); replaces "
                          "the window of layers that are already sliding (Mistral). Default: kept layers stay as "
                          "in the source"},
    )

    def validate(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {list(INITS)}, got {self.init!r}")
        if self.gate not in DELTA_GATES:
            raise ValueError(f"--gate must be one of {list(DELTA_GATES)} (none = DeltaNet, scalar = Gated DeltaNet, "
                             f"channel = KDA), got {self.gate!r}")
        if self.rank_by not in RANKINGS:
            raise ValueError(f"--rank_by must be one of {list(RANKINGS)} (bypass: the cost of zeroing each layer's "
                             f"attention; conversion: the cost of converting it alone), got {self.rank_by!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("calibration_tokens", "calibration_seq_len", "search_windows", "rank_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.calibration_seq_len < 8:
            raise ValueError(f"--calibration-seq-len must be >= 8, got {self.calibration_seq_len}")
        if self.calibration_steps < 0 or self.conv_kernel_size < 0:
            raise ValueError("--calibration-steps and --conv-kernel-size must be >= 0")
        if not 0.0 <= self.induction_share <= 1.0:
            raise ValueError(f"--induction_share must lie in [0, 1], got {self.induction_share}")
        check_window(self.attention_window)

    def delta_options(self) -> DeltaOptions:
        return DeltaOptions(self.gate, self.conv_kernel_size, self.output_gate, self.allow_neg_eigval, self.chunk_size,
                            gqa_state=self.gqa_state)


@dataclasses.dataclass
class ConversionResult:
    """A converted model (None for a dry run) with its plan, settings and figures."""

    model: DeltaForCausalLM | None
    plan: LayerPlan
    settings: ConversionSettings
    memory: MemoryReport
    source_ref: SourceRef | None = None
    source_name: str = ""
    source_model_type: str | None = None
    calibration: dict[int, LayerCalibration] = dataclasses.field(default_factory=dict)
    calibration_tokens: int = 0
    calibration_text: str = "calibration text"
    out: Path | None = None
    evaluation: dict[str, float] = dataclasses.field(default_factory=dict)

    def evaluation_text(self) -> str | None:
        if not self.evaluation:
            return None
        return "\n".join(f"- {name}: {value:.4g}" for name, value in self.evaluation.items())

    def describe(self) -> str:
        return self.plan.describe() + "\n" + self.memory.describe()

    def record(self) -> dict:
        """What `conversion.json` in the output folder holds."""
        return {
            "source": {
                "spec": self.source_ref.spec if self.source_ref else self.source_name,
                "kind": self.source_ref.kind if self.source_ref else "model",
                "path": self.source_ref.path if self.source_ref else None,
                "gguf_file": self.source_ref.gguf_file if self.source_ref else None,
                "model_type": self.source_model_type,
            },
            "settings": dataclasses.asdict(self.settings),
            "plan": {
                "rule": self.plan.rule,
                "source_types": self.plan.source_types,
                "layer_types": self.plan.layer_types,
                "kept": self.plan.kept,
                "ranking": self.plan.ranking,
                "ranked_by": self.plan.ranked_by if self.plan.ranking else None,
                "baseline_perplexity": self.plan.baseline_perplexity,
                "induction": self.plan.induction,
                "attention_window": self.plan.attention_window,
                "sliding_window": self.plan.sliding_window,
                "source_sliding_window": self.plan.source_sliding_window,
            },
            "calibration_tokens": self.calibration_tokens,
            "calibration_text": self.calibration_text,
            "calibration": {str(i): dataclasses.asdict(c) for i, c in self.calibration.items()},
            "memory": self.memory.as_dict(),
            "evaluation": self.evaluation,
        }


# ----------------------------------------------------------------------------------------------- planning


def _perplexity_with_each_layer_replaced(model, windows: torch.Tensor, replacement, desc: str, bf16: bool,
                                        progress: bool):
    """`(baseline_perplexity, {layer: perplexity})` of `model` on `windows`, each layer's attention output replaced in
    turn by `replacement(layer, hidden_states, attention_output)`."""
    modules = [layer.self_attn for layer in model.model.layers]

    def hook_for(i):
        def hook(module, args, kwargs, output):
            hidden_states = args[0] if args else kwargs["hidden_states"]  # [batch, seq_len, hidden]
            attention, extra = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
            replaced = replacement(i, hidden_states, attention).to(attention.dtype)
            return (replaced, *extra) if isinstance(output, tuple) else replaced

        return hook

    baseline = math.exp(mean_nll(model, windows, batch_size=2, bf16=bf16))
    costs = {}
    for i in tqdm(range(len(modules)), desc=desc, disable=not progress):
        handle = modules[i].register_forward_hook(hook_for(i), with_kwargs=True)
        try:
            costs[i] = math.exp(min(mean_nll(model, windows, batch_size=2, bf16=bf16), 700.0))
        finally:
            handle.remove()
    return baseline, costs


def rank_layers_by_bypass(model, windows: torch.Tensor, bf16: bool = True, progress: bool = True):
    """Perplexity of `model` on `windows` with each layer's attention output replaced by zeros.

    Returns `(baseline_perplexity, {layer: perplexity_without_its_attention})`.
    """
    def zeros(layer, hidden_states, attention):
        return torch.zeros_like(attention)

    return _perplexity_with_each_layer_replaced(model, windows, zeros, "ranking layers (bypass each)", bf16, progress)


@dataclasses.dataclass
class EveryLayerConverted:
    """Every layer of a source converted and initialised (`every_layer_converted`): each layer's delta attention
    module (the model around them is not kept: it is the source's own weights), what calibration chose for each
    layer, and the token windows it was initialised on."""

    attention: torch.nn.ModuleList  # [num_layers] delta attention modules, layer i's at index i
    calibration: dict[int, LayerCalibration]
    windows: torch.Tensor  # [N, T] token ids


def every_layer_converted(model, windows: torch.Tensor, settings: ConversionSettings,
                          progress: bool = True) -> EveryLayerConverted:
    """`model` with every layer converted to delta attention and initialised (`settings.init`) from its activations
    on `windows`: each layer as the conversion would make it, whichever layers the plan then keeps."""
    plan = make_plan(source_layer_types(model.config), (), "every layer converted")
    converted = build_delta_model(model, plan, settings)
    calibration = initialise_from_teacher(converted, model, plan, windows, settings, progress)
    attention = torch.nn.ModuleList(layer.self_attn for layer in converted.model.layers)
    return EveryLayerConverted(attention, calibration, windows)


def rank_layers_by_conversion(model, windows: torch.Tensor, converted: EveryLayerConverted, bf16: bool = True,
                              progress: bool = True):
    """Perplexity of `model` on `windows` with each layer's attention replaced, alone, by the same layer of
    `converted` (`every_layer_converted`): what converting that layer costs, where `rank_layers_by_bypass` measures
    what removing it costs (a layer the short conv and the delta rule imitate well costs little even when its
    attention matters).

    Returns `(baseline_perplexity, {layer: perplexity_with_it_converted})`."""
    def delta_layer(layer, hidden_states, attention):
        return converted.attention[layer](hidden_states)[0]

    return _perplexity_with_each_layer_replaced(model, windows, delta_layer, "ranking layers (convert each)", bf16,
                                                progress)


def plan_layers(source_config, settings: ConversionSettings, model=None, rank_windows=None,
                progress: bool = True, spec: KeepSpec | None = None,
                calibration: torch.Tensor | None = None, converted: EveryLayerConverted | None = None) -> LayerPlan:
    """The layer plan for `settings.keep_attention` (`spec`, when already parsed); auto ranking needs `model` and
    `rank_windows`, and with `rank_by="conversion"` every layer converted: `converted`, else made here on the
    `calibration` windows (default: `rank_windows`)."""
    types = source_layer_types(source_config)
    spec = spec or parse_keep(settings.keep_attention, len(types))
    windows = dict(window=settings.attention_window, source_window=getattr(source_config, "sliding_window", None))
    if not spec.is_auto:
        text = spec.text.strip().lower()
        if text in ("all", "none", ""):
            rule = f"keep {text or 'none'}"
        elif "." in text:
            rule = f"ratio {text}, uniform from layer 0"
        else:
            rule = f"explicit list {','.join(map(str, spec.layers))}"
        return make_plan(types, spec.layers, rule, **windows)
    if model is None or rank_windows is None:
        raise ValueError("auto layer selection needs the loaded source model and calibration windows")
    if settings.rank_by == "conversion":
        if converted is None:
            converted = every_layer_converted(model, rank_windows if calibration is None else calibration, settings,
                                              progress)
        baseline, costs = rank_layers_by_conversion(model, rank_windows, converted, settings.bf16, progress)
    else:
        baseline, costs = rank_layers_by_bypass(model, rank_windows, settings.bf16, progress)
    slots = copy_slots(spec.auto_count, settings.induction_share)
    induction = None
    if slots:
        sequences = repeated_sequences(rank_windows, INDUCTION_PROBE_LENGTH, INDUCTION_PROBE_COUNT, settings.seed)
        induction = induction_layers(induction_scores(model, sequences, settings.bf16))
    kept = choose_auto(costs, spec.auto_count, settings.keep_first_layer, induction or [], slots)
    ranking = sorted(costs.items(), key=lambda item: (-item[1], item[0]))
    rule = (f"{spec.text}: " + ("layer 0, " if settings.keep_first_layer else "")
            + (f"up to {slots} layers with induction heads, then " if slots else "")
            + f"the layers whose {'conversion' if settings.rank_by == 'conversion' else 'bypass'} costs most "
              "perplexity")
    return make_plan(types, kept, rule, ranking=ranking, ranked_by=settings.rank_by, baseline_perplexity=baseline,
                     induction=induction, **windows)


def _plan_for(source: Source, tokenizer, settings: ConversionSettings, calibration_texts=None, progress: bool = True,
              spec: KeepSpec | None = None) -> tuple[LayerPlan, EveryLayerConverted | None]:
    """The plan for a loaded source: `--keep-attention` parsed once, and auto plans ranked on calibration text;
    with the every-layer conversion that a `rank_by="conversion"` ranking made (else None), for `convert_model`."""
    config = source.model.config
    spec = spec or parse_keep(settings.keep_attention, config.num_hidden_layers)
    rank_windows = converted = None
    if spec.is_auto:
        rank_windows = calibration_windows(tokenizer, settings, config.vocab_size, calibration_texts,
                                           settings.rank_tokens)
        if settings.rank_by == "conversion":
            calibration = calibration_windows(tokenizer, settings, config.vocab_size, calibration_texts)
            converted = every_layer_converted(source.model, calibration, settings, progress)
    plan = plan_layers(config, settings, source.model, rank_windows, progress, spec=spec, converted=converted)
    return plan, converted


# ----------------------------------------------------------------------------------------------- building


def build_delta_model(source_model, plan: LayerPlan, settings: ConversionSettings) -> DeltaForCausalLM:
    """A `DeltaForCausalLM` (float32) with the source's weights mapped in and the `copy` init for new ones."""
    check_layout(source_model)
    config = delta_config_from_source(source_model.config, plan.layer_types, settings.delta_options(), model=source_model,
                                      sliding_window=plan.sliding_window)
    torch.manual_seed(settings.seed)
    model = DeltaForCausalLM(config).float().eval()
    kept = set(plan.kept)
    copy_shared_weights(source_model, model, kept)
    generator = torch.Generator().manual_seed(settings.seed)
    for i in plan.delta:
        attn = model.model.layers[i].self_attn
        copy_delta_projections(source_model.model.layers[i].self_attn, attn, config.num_key_value_heads)
        I.init_new_parameters(attn, generator)
    generation_config = getattr(source_model, "generation_config", None)
    if generation_config is not None:
        model.generation_config = copy.deepcopy(generation_config)
    return model


def initialise_from_teacher(student, teacher, plan: LayerPlan, windows: torch.Tensor, settings: ConversionSettings,
                            progress: bool = True) -> dict[int, LayerCalibration]:
    """Run the teacher once over `windows` and calibrate every delta layer from its activations."""
    if not plan.delta:
        return {}
    calibrated = settings.init == "calibrated"
    acts = collect_teacher_activations(
        teacher, windows, plan.delta, batch_size=1, attention_stats=calibrated, bf16=settings.bf16,
        store_heads=calibrated, progress=progress,
    )
    results = {}
    for i in tqdm(plan.delta, desc=f"{settings.init} init of delta layers", disable=not progress):
        results[i] = calibrate_layer(
            student.model.layers[i].self_attn, acts.pop(i), init=settings.init, steps=settings.calibration_steps,
            lr=settings.calibration_lr, search_windows=settings.search_windows, bf16=settings.bf16,
            seed=settings.seed + i,
        )
    return results


def _take_delta_layers(student, converted: EveryLayerConverted, plan: LayerPlan) -> dict[int, LayerCalibration]:
    """Copy the plan's delta layers into `student` from `converted` (every layer made as the conversion makes them),
    so that they are the layers the ranking measured; returns their calibration records."""
    for i in plan.delta:
        student.model.layers[i].self_attn.load_state_dict(converted.attention[i].state_dict())
    return {i: converted.calibration[i] for i in plan.delta if i in converted.calibration}


def calibration_windows(tokenizer, settings: ConversionSettings, vocab_size: int, texts=None,
                        num_tokens: int | None = None) -> torch.Tensor:
    """Token windows of calibration text: `texts`, else the assets' training split; random ids without a tokenizer."""
    seq_len = settings.calibration_seq_len
    count = max(1, (num_tokens or settings.calibration_tokens) // seq_len)
    if tokenizer is None:
        return random_windows(vocab_size, seq_len, count, seed=settings.seed)
    if texts is None:
        from ..data.assets import train_texts

        texts = train_texts()
    return token_windows(tokenizer, list(texts), seq_len, count)


def source_spec(ref: SourceRef) -> str:
    """A spec that loads the source from anywhere: the Hub id, or the absolute folder / `.gguf` path."""
    if ref.kind == "gguf":
        return str(Path(ref.path) / ref.gguf_file)
    return ref.path


def _cast_parameters(model, dtype: torch.dtype) -> None:
    """Cast the parameters only: buffers such as RoPE's `inv_freq` stay float32, as `from_pretrained` leaves them."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    model.config.dtype = dtype


def _output_dtype(settings: ConversionSettings, source_model) -> torch.dtype:
    if settings.dtype == "auto":
        return next(source_model.parameters()).dtype
    return getattr(torch, settings.dtype)


def convert_model(source, settings: ConversionSettings | None = None, tokenizer=None, calibration_texts=None,
                  windows: torch.Tensor | None = None, plan: LayerPlan | None = None,
                  progress: bool = True, converted: EveryLayerConverted | None = None) -> ConversionResult:
    """Convert an already loaded source (a `Source` or a Llama-layout `PreTrainedModel`) in memory.

    `windows` ([N, T] token ids) overrides the calibration text; without a tokenizer random ids are used.
    `converted` (every layer already converted and initialised, as a `rank_by="conversion"` plan makes them) gives
    the delta layers as they are, with their windows, instead of initialising them again.
    The returned model is in the output dtype (`settings.dtype`) and eval mode.
    """
    settings = settings or ConversionSettings()
    settings.validate()
    if not isinstance(source, Source):
        source = Source(None, source, tokenizer)
    teacher = source.model.eval()
    check_supported(teacher.config)
    check_layout(teacher)
    tokenizer = tokenizer if tokenizer is not None else source.tokenizer
    vocab = teacher.config.vocab_size
    if converted is not None and windows is not None:
        raise ValueError("convert_model: pass either `windows` or `converted` (whose layers were initialised on its "
                         "own windows), not both")
    if plan is None:
        plan, ranked = _plan_for(source, tokenizer, settings, calibration_texts, progress)
        converted = ranked if windows is None else None  # windows given: the plan's layers are initialised on them
    student = build_delta_model(teacher, plan, settings)
    calibration, used = {}, 0
    described = "the given token windows" if windows is not None else (
        "random token ids (the source has no tokenizer)" if tokenizer is None else
        "the given calibration text" if calibration_texts is not None else
        "the assets' training text (the default builtin:train mix; held-out documents excluded)")
    if plan.delta and converted is not None:
        used = converted.windows.numel()
        calibration = _take_delta_layers(student, converted, plan)
    elif plan.delta:
        if windows is None:
            windows = calibration_windows(tokenizer, settings, vocab, calibration_texts)
        used = windows.numel()
        calibration = initialise_from_teacher(student, teacher, plan, windows, settings, progress)
    _cast_parameters(student, _output_dtype(settings, teacher))
    student.eval()
    if source.ref is not None:
        setattr(student.config, SOURCE_ATTRIBUTE, source_spec(source.ref))
    memory = memory_report(teacher.config, student.config, plan.source_types, _output_dtype(settings, teacher),
                           source_parameters=count_parameters(teacher), converted_parameters=count_parameters(student))
    return ConversionResult(
        student, plan, settings, memory, source.ref, source.name, getattr(teacher.config, "model_type", None),
        calibration, used, described,
    )


# ----------------------------------------------------------------------------------------------- saving


def check_output(out, overwrite: bool, source_ref: SourceRef | None = None, force: bool = False) -> Path:
    """Refuse an output folder `convert` may not write (see `output_folder.check_output_folder`): an existing one
    without `overwrite`, one this tool did not write without `force`, a file, the current directory, a folder
    holding the source, or a place that is not writable."""
    inputs = (source_ref.path if source_ref.kind == "folder" else str(Path(source_ref.path) / source_ref.gguf_file),) \
        if source_ref is not None and source_ref.kind in ("folder", "gguf") else ()
    return check_output_folder(out, overwrite=overwrite, force=force, inputs=inputs, flag="--out")


def save_converted(result: ConversionResult, out, tokenizer=None, overwrite: bool = False,
                   progress: bool = True, force: bool = False) -> Path:
    """Write model, custom code, tokenizer, generation config, card and `conversion.json` to `out`, atomically."""
    from ..publishing.cards import conversion_card

    out = check_output(out, overwrite, result.source_ref, force)
    steps = ["weights and model code", "tokenizer", "model card", "conversion record"]

    def write(staging: Path) -> None:
        with tqdm(total=len(steps), desc="saving", disable=not progress) as bar:
            bar.set_postfix_str(steps[0])
            result.model.save_pretrained(staging)
            bar.update()
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            bar.update()
            conversion_card(result, model_path=out.name, has_tokenizer=tokenizer is not None).save(staging / "README.md")
            bar.update()
            (staging / "conversion.json").write_text(json.dumps(result.record(), indent=2) + "\n")
            bar.update()

    result.out = out
    try:
        atomic_save(write, out)
    except BaseException:
        result.out = None
        raise
    return out


def convert(source, out=None, settings: ConversionSettings | None = None, overwrite: bool = False,
            dry_run: bool = False, calibration_texts=None, progress: bool = True, log=print,
            force_overwrite: bool = False, tokenizer: bool = True) -> ConversionResult:
    """Convert SOURCE (Hub id, folder, `.gguf` file, or a loaded `Source`) and save it to `out`.

    With `dry_run` the plan (layer map, parameter counts, state vs KV bytes) is printed and returned and
    nothing is written; `auto:` plans still load the model to rank its layers. `overwrite` replaces an `out`
    that this tool wrote (`force_overwrite`: any folder). `tokenizer=False` converts without the source's
    tokenizer (calibration on random token ids, none saved); otherwise a tokenizer that fails to load is an error.
    """
    settings = settings or ConversionSettings()
    settings.validate()
    if out is None and not dry_run:
        raise ValueError("an output folder is needed (--out DIR), or --dry-run")
    ref = source.ref if isinstance(source, Source) else resolve(source)
    if out is not None:
        check_output(out, overwrite, ref, force_overwrite)
    config = source.config if isinstance(source, Source) else load_config(ref)
    check_supported(config)
    spec = parse_keep(settings.keep_attention, config.num_hidden_layers)
    # option values the model config rejects (e.g. a bad gate) fail here, before any loading
    delta_config_from_source(config, [DELTA_LAYER] * config.num_hidden_layers, settings.delta_options())

    if dry_run and not spec.is_auto:
        plan = plan_layers(config, settings, spec=spec)
        delta_config = delta_config_from_source(config, plan.layer_types, settings.delta_options(),
                                                sliding_window=plan.sliding_window)
        dtype = config.dtype if settings.dtype == "auto" and getattr(config, "dtype", None) else settings.dtype
        dtype = torch.float32 if dtype in ("auto", None) else dtype
        memory = memory_report(_plain_config(config), delta_config, plan.source_types, dtype)
        result = ConversionResult(None, plan, settings, memory, ref, ref.name if ref else "",
                                  getattr(config, "model_type", None))
        log(result.describe())
        log("dry run: nothing written")
        return result

    loaded = source if isinstance(source, Source) else load_source(ref, with_tokenizer=tokenizer)
    if not tokenizer:
        loaded.tokenizer = None
    plan, converted = _plan_for(loaded, loaded.tokenizer, settings, calibration_texts, progress, spec=spec)
    if dry_run:
        delta_config = delta_config_from_source(loaded.config, plan.layer_types, settings.delta_options(),
                                                model=loaded.model, sliding_window=plan.sliding_window)
        memory = memory_report(_plain_config(loaded.config), delta_config, plan.source_types,
                               _output_dtype(settings, loaded.model), source_parameters=count_parameters(loaded.model))
        result = ConversionResult(None, plan, settings, memory, ref, loaded.name, getattr(config, "model_type", None))
        log(result.describe())
        log("dry run: nothing written")
        return result

    result = convert_model(loaded, settings, calibration_texts=calibration_texts, plan=plan, progress=progress,
                           converted=converted)
    del converted
    log(result.describe())
    save_converted(result, out, tokenizer=loaded.tokenizer, overwrite=overwrite, progress=progress,
                   force=force_overwrite)
    log(f"saved to {result.out}")
    return result


def _plain_config(config):
    """A copy of a source config without GGUF/quantization settings, for counting on the meta device."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


__all__ = [
    "ConversionResult",
    "ConversionSettings",
    "EveryLayerConverted",
    "build_delta_model",
    "calibration_windows",
    "check_output",
    "convert",
    "convert_model",
    "every_layer_converted",
    "initialise_from_teacher",
    "plan_layers",
    "rank_layers_by_bypass",
    "rank_layers_by_conversion",
    "save_converted",
]
