"""`push`: publish a model folder (weights, custom code, tokenizer, card) or a LoRA adapter to a Hub repo.

The folder is staged in a temporary copy: the user's folder is never modified. In the copy, the card is
completed (base_model, license, datasets, tags, library_name, pipeline_tag; model-index as distill/evaluate
left it; the usage snippet pointed at the repo), an adapter's `base_model_name_or_path` is set to the base
model's Hub id, every absolute path of this machine in any text file (card, JSON, code) is replaced by the base
model's id or the file's name, and everything goes up in one commit, card included, so no default card is ever
written.
Tokens come from the usual huggingface_hub places (`HF_TOKEN`, `hf auth login`); none is printed or written.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from .cards import GATE_NAMES, render

# pickle-like weight files: matched on the lower-cased name's last suffix, once archive suffixes are dropped
# (so `model.PT`, `optimizer.pth.tar` and `state.pkl.gz` are all refused, but `README.pt.md` is not)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
ARCHIVE_SUFFIXES = (".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".lzma", ".zip")
SKIPPED = ("checkpoints", ".git", ".cache")  # never uploaded, at any depth (nor is any hidden entry)


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


def is_pickle_name(name: str) -> bool:
    """Whether a file name looks like a pickle (torch/joblib/pickle), whatever its case or archive suffixes."""
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    while suffixes and suffixes[-1] in ARCHIVE_SUFFIXES:
        suffixes.pop()
    return bool(suffixes) and suffixes[-1] in PICKLE_SUFFIXES


def upload_plan(folder: Path) -> list[tuple[Path, str]]:
    """The files `push` would upload, as (file to read, path in the repo), walking the whole tree.

    Hidden entries and SKIPPED names are left out at every depth. A symbolic link is followed only when
    it stays inside the folder (its target's content goes up under the link's name); one that leaves the
    folder, dangles or loops back is refused, so no file from elsewhere on this machine is ever uploaded.
    """
    root = folder.resolve()
    plan: list[tuple[Path, str]] = []

    def walk(directory: Path, prefix: str, ancestors: frozenset[Path]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.name.startswith(".") or entry.name in SKIPPED:
                continue
            name = prefix + entry.name
            real = Path(os.path.realpath(entry.path))
            if entry.is_symlink():
                where = os.readlink(entry.path)
                if real != root and root not in real.parents:
                    raise ValueError(f"{folder}: {name} is a symbolic link to {where}, outside the folder; push "
                                     "uploads only what is inside it: copy the file in or remove the link")
                if not real.exists():
                    raise ValueError(f"{folder}: {name} is a symbolic link to {where}, which does not exist; "
                                     "remove the link or restore its target")
                if is_pickle_name(real.name):
                    raise ValueError(f"{folder}: {name} is a symbolic link to the pickle weight file {where}; "
                                     "re-save it as safetensors before pushing")
            if real.is_dir():
                if real in ancestors:
                    raise ValueError(f"{folder}: {name} is a symbolic link to {os.readlink(entry.path)}, a folder "
                                     "that contains it, so the tree never ends; remove the link")
                walk(real, name + "/", ancestors | {real})
            elif real.is_file():
                plan.append((real, name))
            else:
                raise ValueError(f"{folder}: {name} is not a regular file or folder (a pipe, socket or device); "
                                 "move it out of the folder before pushing")

    walk(root, "", frozenset({root}))
    return plan


def _check_folder(folder: Path) -> tuple[str, list[tuple[Path, str]]]:
    """('model' or 'adapter', the upload plan); raises with the fix when the folder is neither or holds pickles."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    plan = upload_plan(folder)
    pickles = sorted(name for _, name in plan if is_pickle_name(name))
    if pickles:
        raise ValueError(f"{folder} holds pickle weight files {pickles}; re-save them as safetensors before pushing")
    names = {name for _, name in plan}
    if "adapter_config.json" in names:
        return "adapter", plan
    if "config.json" in names and any("/" not in name and name.endswith(".safetensors") for name in names):
        return "model", plan
    raise ValueError(f"{folder} is neither a model folder (config.json + *.safetensors) nor a PEFT adapter "
                     "(adapter_config.json)")


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"--repo_id {repo_id!r} is not a Hub repo id: write OWNER/NAME or NAME, using letters, "
                         "digits, '-', '_' and '.' (not at either end, no '--' or '..', at most 96 characters); "
                         "nothing was pushed") from None


def _stage(plan: list[tuple[Path, str]], staging: Path) -> None:
    for source, name in plan:
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _network_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the Hub could not be reached (HfHubHTTPError, a reply from the Hub, is handled first)."""
    errors: list[type[BaseException]] = [OSError]  # socket errors, requests' errors, OfflineModeIsEnabled
    for name in ("httpx", "httpx2"):  # the HTTP client of huggingface_hub 1.x / 2.x; their errors are not OSErrors
        try:
            errors.append(importlib.import_module(name).RequestError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _first_line(text: str, token: str) -> str:
    """The first line of an error's text, with the token (should a server or library echo it) masked."""
    lines = (text or "").strip().splitlines()
    return lines[0].replace(token, "***") if lines else ""


# an absolute path in text: starts after a non-path character (or after `file://`), runs to whitespace, a quote,
# a bracket or a separator; URLs (`https://host/path`) do not match since their `/path` follows the host
_ABSOLUTE_PATH = re.compile(r"(?:(?<=file://)|(?<![\w.~/:-]))/[^\s\"'`<>|:;,()\[\]{}]+")
MODEL_SUFFIXES = (".gguf", ".safetensors")


def _is_machine_path(path: str) -> bool:
    """Whether an absolute path in a text names something of this machine (its first part exists here)."""
    first = path.strip("/").split("/")[0]
    return bool(first) and os.path.isdir(os.sep + first)


def _is_model_path(path: str) -> bool:
    """Whether a path names a model: a GGUF/safetensors file or a folder holding a config or an adapter."""
    return path.lower().endswith(MODEL_SUFFIXES) or any(
        os.path.isfile(os.path.join(path, name)) for name in ("config.json", "adapter_config.json"))


def without_local_paths(text: str, base_model: str | None, json_string: bool = False,
                        models: frozenset[str] = frozenset()) -> str:
    """`text` with every absolute path of this machine replaced: a model (or one of `models`, paths recorded as
    models) by `base_model` when given, anything else by its file name (`/home/me/x/notes.txt` -> `notes.txt`)."""

    def replace(match: re.Match) -> str:
        path = match.group(0).rstrip(".")
        if not _is_machine_path(path):
            return match.group(0)
        is_model = path.rstrip("/") in models or _is_model_path(path)
        name = (base_model if base_model and is_model else None) or Path(path).name or "."
        if json_string:
            name = json.dumps(name)[1:-1]
        return name + match.group(0)[len(path):]

    return _ABSOLUTE_PATH.sub(replace, text)


def _text_of(path: Path) -> str | None:
    """The file's text when it is a UTF-8 text file (no NUL byte), else None (weights and other binaries)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _recorded_models(staging: Path) -> frozenset[str]:
    """The model paths the staged JSON records (conversion source, `_name_or_path`, an adapter's base), so they
    count as models even once gone from this machine."""
    found = set()
    for name, keys in (("config.json", ("conversion_source", "_name_or_path")),
                       ("adapter_config.json", ("base_model_name_or_path",)), ("conversion.json", ())):
        try:
            data = json.loads((staging / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        values = [data.get(key) for key in keys] + [(data.get("source") or {}).get("spec")]
        found.update(v.rstrip("/") for v in values if isinstance(v, str) and os.path.isabs(v))
    return frozenset(found)


def scrub_local_paths(staging: Path, base_model: str | None) -> list[str]:
    """Keep this machine's paths out of every text file of the staged upload (cards, JSON, code, notes).

    Each absolute path of this machine (the recorded conversion source, a data file, the home folder...) becomes
    the base model's Hub id when it names a model and one is given, otherwise its file name. Returns the names
    of the files changed."""
    changed, models = [], _recorded_models(staging)
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        text = _text_of(path)
        if text is None:
            continue
        cleaned = without_local_paths(text, base_model, path.suffix.lower() == ".json", models)
        home = str(Path.home())
        if len(home) > 1:  # the home folder written some other way (e.g. after a host): it becomes `~`
            cleaned = re.sub(re.escape(home) + r"(?![\w.-])", "~", cleaned)
        if cleaned != text:
            path.write_text(cleaned, encoding="utf-8")
            changed.append(str(path.relative_to(staging)))
    return changed


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
    _check_repo_id(options.repo_id)
    folder = Path(options.folder)
    kind, plan = _check_folder(folder)
    token = get_token()
    if not token:
        raise ValueError("no Hugging Face token found: run `hf auth login` or set HF_TOKEN; nothing was pushed")
    with tempfile.TemporaryDirectory(prefix="delta-push-") as tmp:
        staging = Path(tmp)
        _stage(plan, staging)
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
        model_card_for_push(staging, kind, options).save(staging / "README.md")
        scrub_local_paths(staging, options.base_model)  # the card included

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
            detail = _first_line(error.server_message or str(error), token)
            raise ValueError(f"the Hub refused the push to {options.repo_id} (HTTP {status}: {detail}); "
                             "check the repo name and that your token may write there. The local folder is "
                             "unchanged.") from None
        except _network_errors() as error:
            parts = urlparse(api.endpoint)
            host = parts.hostname or api.endpoint
            host = f"{host}:{parts.port}" if parts.port else host
            detail = _first_line(str(error), token)
            reason = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
            raise ValueError(f"could not reach the Hub at {host} ({reason}); check the network connection and "
                             "HF_ENDPOINT, then push again. Nothing was pushed; the local folder is unchanged.") from None
    return commit.pr_url or commit.commit_url
