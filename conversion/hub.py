"""`push`: publish a model folder (weights, custom code, tokenizer, card) or a LoRA adapter to a Hub repo.

The folder is staged in a temporary copy: the user's folder is never modified. In the copy, the card is
completed (base_model, license, datasets, tags, library_name, pipeline_tag; model-index as distill/evaluate
left it; the usage snippet pointed at the repo), an adapter's `base_model_name_or_path` is set to the base
model's Hub id, and everything goes up in one commit, card included, so no default card is ever written.
Tokens come from the usual huggingface_hub places (`HF_TOKEN`, `hf auth login`); none is printed or written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import HfHubHTTPError

from .card import GATE_NAMES, render

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
SKIPPED = ("checkpoints", ".git", ".cache")


@dataclasses.dataclass
class PushOptions:
    """What to push where."""

    folder: str = dataclasses.field(default=None, metadata={"help": "model or adapter folder", "positional": True})
    repo_id: str = dataclasses.field(default=None, metadata={"help": "target Hub repo, owner/name"})
    private: bool = dataclasses.field(default=False, metadata={"help": "create the repo private"})
    revision: str | None = dataclasses.field(default=None, metadata={"help": "branch to push to (created if needed)"})
    create_pr: bool = dataclasses.field(default=False, metadata={"help": "open a pull request instead of committing"})
    commit_message: str | None = dataclasses.field(default=None, metadata={"help": "commit message"})
    base_model: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub id of the base/source model (card base_model; an adapter's base)"}
    )
    license: str | None = dataclasses.field(default=None, metadata={"help": "license id; default: the card's"})
    datasets: str | None = dataclasses.field(default=None, metadata={"help": "comma-separated Hub dataset ids"})


def _is_local_path(name: str | None) -> bool:
    return bool(name) and (os.path.isabs(name) or name.startswith((".", "~")) or Path(name).exists())


def _check_folder(folder: Path) -> str:
    """'model' or 'adapter'; raises with the fix when the folder is neither or holds pickles."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{folder} holds pickle weight files {pickles}; re-save them as safetensors before pushing")
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return "model"
    raise ValueError(f"{folder} is neither a model folder (config.json + *.safetensors) nor a PEFT adapter "
                     "(adapter_config.json)")


def _stage(folder: Path, staging: Path) -> None:
    for item in folder.iterdir():
        if item.name.startswith(".") or item.name in SKIPPED:
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, staging / item.name)


def _without_local_paths(value, replacement):
    """`value` (JSON data) with every absolute local path replaced by `replacement(path)`."""
    if isinstance(value, dict):
        return {k: _without_local_paths(v, replacement) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_local_paths(v, replacement) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return replacement(value)
    return value


def scrub_local_paths(staging: Path, base_model: str | None) -> None:
    """Keep this machine's paths out of the pushed JSON files (the recorded conversion source, mostly)."""
    for name in ("config.json", "conversion.json"):
        path = staging / name
        if path.is_file():
            data = json.loads(path.read_text())
            cleaned = _without_local_paths(data, lambda p: base_model or Path(p).name)
            if cleaned != data:
                path.write_text(json.dumps(cleaned, indent=2) + "\n")


def _point_usage_at(text: str, repo_id: str) -> str:
    """Make every `from_pretrained("...")` in the card's code load from `repo_id`."""
    return re.sub(r'from_pretrained\(\s*"[^"]*"', f'from_pretrained("{repo_id}"', text)


def model_card_for_push(staging: Path, kind: str, options: PushOptions) -> ModelCard:
    """The card to publish: the folder's own card completed for the Hub, or a new one for an adapter."""
    datasets = [d.strip() for d in options.datasets.split(",")] if options.datasets else None
    if kind == "adapter":
        adapter = json.loads((staging / "adapter_config.json").read_text())
        data = ModelCardData(library_name="peft", pipeline_tag="text-generation", base_model=options.base_model,
                             license=options.license, datasets=datasets,
                             tags=["delta-attention", "linear-attention", "lora", "peft"])
        return render("adapter.md", data, repo_id=options.repo_id, base_model=options.base_model,
                      r=adapter.get("r"), lora_alpha=adapter.get("lora_alpha"),
                      target_modules=adapter.get("target_modules"))
    config = json.loads((staging / "config.json").read_text())
    readme = staging / "README.md"
    card = ModelCard(_point_usage_at(readme.read_text(), options.repo_id)) if readme.is_file() else \
        ModelCard.from_template(ModelCardData(), template_str="---\n{{ card_data }}\n---\n\n# {{ repo_id }}\n",
                                repo_id=options.repo_id)
    data = card.data
    data.library_name = "transformers"
    data.pipeline_tag = "text-generation"
    gate = config.get("linear_gate")
    tags = list(data.tags or []) + ["delta-attention", "linear-attention"]
    if gate in GATE_NAMES:
        tags.append({"none": "deltanet", "scalar": "gated-deltanet", "channel": "kimi-delta-attention"}[gate])
    data.tags = list(dict.fromkeys(tags))
    data.base_model = options.base_model or data.base_model
    data.license = options.license or data.license
    data.datasets = datasets or data.datasets
    return card


def push(options: PushOptions) -> str:
    """Push `options.folder` to `options.repo_id`; returns the commit (or pull request) URL."""
    if not options.folder or not options.repo_id:
        raise ValueError("give the folder and the repo: delta-attention push FOLDER --repo_id OWNER/NAME")
    if options.create_pr and options.revision:
        raise ValueError("--create_pr opens a pull request against the default branch; drop --revision")
    folder = Path(options.folder)
    kind = _check_folder(folder)
    token = get_token()
    if not token:
        raise ValueError("no Hugging Face token found: run `hf auth login` or set HF_TOKEN; nothing was pushed")
    with tempfile.TemporaryDirectory(prefix="delta-push-") as tmp:
        staging = Path(tmp)
        _stage(folder, staging)
        if kind == "adapter":
            adapter_config = staging / "adapter_config.json"
            config = json.loads(adapter_config.read_text())
            base = config.get("base_model_name_or_path")
            if _is_local_path(base) or options.base_model:
                if not options.base_model:
                    raise ValueError("the adapter's base model is a local folder; pass --base_model OWNER/NAME, "
                                     "the Hub repo of that base model (push it first)")
                config["base_model_name_or_path"] = options.base_model
                adapter_config.write_text(json.dumps(config, indent=2))
            options = dataclasses.replace(options, base_model=config["base_model_name_or_path"])
        scrub_local_paths(staging, options.base_model)
        model_card_for_push(staging, kind, options).save(staging / "README.md")

        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
        message = options.commit_message or f"Upload delta-attention {kind}"
        try:
            api.create_repo(options.repo_id, private=options.private, exist_ok=True)
            if options.revision and not options.create_pr:
                api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
            commit = api.upload_folder(repo_id=options.repo_id, folder_path=staging, revision=options.revision,
                                       create_pr=options.create_pr, commit_message=message)
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else "?"
            detail = (error.server_message or str(error)).strip().splitlines()[0]
            raise ValueError(f"the Hub refused the push to {options.repo_id} (HTTP {status}: {detail}); "
                             "check the repo name and that your token may write there. The local folder is "
                             "unchanged.") from None
    return commit.pr_url or commit.commit_url
