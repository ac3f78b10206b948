"""The `delta-attention` console command: one command, one subcommand per job.

Each subcommand lives in its own module under `delta_attention.scripts`, which defines its options
dataclass `Options` (or a tuple of dataclasses) and `run(*options)`. Options come from flags (`--name value`) or from one YAML file
(`delta-attention convert config.yaml`), read by `transformers.HfArgumentParser`. A field whose metadata has
`"positional": True` may also be given as the first bare argument (`delta-attention convert SOURCE ...`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
import types

SUBCOMMANDS = {
    "assets": ("delta_attention.scripts.assets", "fetch the offline model and text corpora into the cache folder"),
    "convert": ("delta_attention.scripts.convert", "convert a Llama/Mistral/Qwen checkpoint to delta attention"),
    "distill": ("delta_attention.scripts.distill", "distill a converted model from its teacher"),
    "generate-data": ("delta_attention.scripts.generate_data", "have a teacher write training text and chat answers"),
    "finetune": ("delta_attention.scripts.finetune", "LoRA fine-tuning of a delta model"),
    "evaluate": ("delta_attention.scripts.evaluate", "perplexity, passkey retrieval, speed and memory"),
    "push": ("delta_attention.scripts.push", "push a model or adapter folder to the Hub"),
    "benchmark": ("delta_attention.scripts.benchmark", "kernel, decode, prefill and long-context benchmarks"),
    "bench-distill": ("delta_attention.scripts.bench_distill", "distil SmolLM2 hybrid and all-delta in a time budget"),
    "bench-long-context": ("delta_attention.scripts.bench_long_context",
                           "SmolLM2 converted four ways (full/sliding hybrid, all-delta, GQA state) at long context"),
    "bench-speculative": ("delta_attention.scripts.bench_speculative",
                          "prompt lookup and assistant vs greedy; answers from a saved state"),
    "sweep-recipe": ("delta_attention.scripts.sweep_recipe",
                     "short distillations changing one recipe knob each, chosen by cross-domain perplexity"),
}


def _usage() -> str:
    lines = ["usage: delta-attention <subcommand> [--option value ... | config.yaml]", "", "subcommands:"]
    for name, (module, help_text) in SUBCOMMANDS.items():
        if _available(module):
            lines.append(f"  {name:<10} {help_text}")
    lines.append("")
    lines.append("`delta-attention <subcommand> --help` lists a subcommand's options.")
    return "\n".join(lines)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _argument_parser(classes: tuple, prog: str):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, field):
            # our own metadata key is not an argparse keyword
            if "positional" in field.metadata:
                field = copy.copy(field)
                field.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != "positional"})
            HfArgumentParser._parse_dataclass_field(parser, field)

    return Parser(classes, prog=prog)


def parse_options(options_classes, argv: list[str], prog: str) -> tuple:
    """Parse `argv` into the dataclass(es): flags, one YAML/JSON file, or a leading positional argument.

    Unknown flags, unknown keys and unreadable option files raise `ValueError` with a one-line message."""
    classes = options_classes if isinstance(options_classes, tuple) else (options_classes,)
    parser = _argument_parser(classes, prog)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
        return _parse_file(parser, argv[0])
    positional = [f for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("positional")]
    if argv and not argv[0].startswith("-") and positional:
        argv = [f"--{positional[0].name}", argv[0], *argv[1:]]
    *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise ValueError(f"unknown option(s) {' '.join(unknown)}; `{prog} --help` lists the options")
    return tuple(parsed)


def _parse_file(parser, path: str) -> tuple:
    """Options from one YAML or JSON file, with errors that name the file and the problem."""
    import json

    import yaml

    try:
        text = open(path, encoding="utf-8").read()
    except OSError as error:
        raise FileNotFoundError(f"options file {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        detail = " ".join(str(error).split())
        raise ValueError(f"options file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{detail}") from None
    if not isinstance(data, dict):
        raise ValueError(f"options file {path} must hold a mapping of option names to values, got "
                         f"{type(data).__name__}")
    known = {f.name for cls in parser.dataclass_types for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"options file {path} has unknown option(s) {unknown}; `--help` lists the options")
    try:
        return tuple(parser.parse_dict(data))
    except (TypeError, ValueError) as error:
        raise ValueError(f"options file {path}: {error}") from None


#: what a user can cause and fix: printed as one line, no traceback
USER_ERRORS = (ValueError, OSError, ArithmeticError)


def main(argv: list[str] | None = None) -> int:
    from delta_attention.conversion.output_folder import sigterm_raises

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS or not _available(SUBCOMMANDS[name][0]):
        available = [n for n, (m, _) in SUBCOMMANDS.items() if _available(m)]
        print(f"delta-attention: unknown subcommand {name!r}; choose one of {available}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    with sigterm_raises():
        try:
            options = parse_options(module.Options, rest, prog=f"delta-attention {name}")
            result = module.run(*options)
        except USER_ERRORS as error:
            # user errors (and a diverged training run): one clear line, no traceback
            print(f"delta-attention {name}: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"delta-attention {name}: interrupted", file=sys.stderr)
            return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
