"""Training checkpoints: safetensors only, written atomically, resumable.

A checkpoint folder `checkpoints/step-000123/` holds
* `trainable.safetensors`: the parameters being trained (by name),
* `optimizer.safetensors` + `optimizer.json`: the optimizer's tensors and the rest of its state dict,
* `state.json`: step, tokens seen, the scheduler's state and anything the caller adds,
* `rng-rank{i}.safetensors` + `rng-rank{i}.json`, one pair per process: the random number generators of
  process `i` (torch CPU and CUDA, Python `random`, NumPy), so that dropout continues exactly on resume.
It is written under a temporary name and renamed when complete; `checkpoints/latest` names the newest
complete one. No pickle is written or read. A checkpoint that is damaged (a truncated file, a missing one,
JSON that does not parse) is skipped for the newest usable one (`find_checkpoint`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..output_folder import user_umask


LATEST = "latest"
FILES = ("trainable.safetensors", "optimizer.safetensors", "optimizer.json", "state.json")
_STEP_NAME = re.compile(r"step-(\d+)")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, path)
    os.chmod(path, 0o666 & ~user_umask())  # safetensors writes 0600 files; give them the user's umask


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state_dict["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> dict:
    """This process's random number generator states: `{"tensors": {...}, "json": {...}}` (no pickle needed).

    Tensors: the torch CPU generator, each CUDA device's generator (when CUDA is up) and NumPy's MT19937 key;
    JSON: Python `random`'s state and the rest of NumPy's."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    kind, key, position, has_gauss, cached = numpy.random.get_state()
    tensors["numpy_key"] = torch.from_numpy(numpy.asarray(key, dtype=numpy.int64))
    version, internal, gauss = random.getstate()
    meta = {"python": {"version": version, "internal": list(internal), "gauss": gauss},
            "numpy": {"kind": kind, "position": int(position), "has_gauss": int(has_gauss), "cached": float(cached)}}
    return {"tensors": tensors, "json": meta}


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (CUDA generators only where this process has as many devices)."""
    tensors, meta = state["tensors"], state["json"]
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() >= len(cuda):
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    python = meta["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    kind = meta["numpy"]
    numpy.random.set_state((kind["kind"], tensors["numpy_key"].numpy().astype(numpy.uint32), kind["position"],
                            kind["has_gauss"], kind["cached"]))


def _rng_files(folder: Path, rank: int) -> tuple[Path, Path]:
    return folder / f"rng-rank{rank}.safetensors", folder / f"rng-rank{rank}.json"


def load_rng_state(path: str | Path, rank: int) -> dict | None:
    """The generator states process `rank` saved in checkpoint `path`, or None when it has none (an older
    checkpoint, or one written by fewer processes)."""
    tensors_path, json_path = _rng_files(Path(path), rank)
    if not (tensors_path.is_file() and json_path.is_file()):
        return None
    return {"tensors": load_file(tensors_path), "json": json.loads(json_path.read_text())}


def _step_folders(folder: Path) -> list[Path]:
    """The `step-*` folders under `folder`, oldest first."""
    found = [p for p in folder.glob("step-*") if _STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(
    folder: str | Path,
    step: int,
    named_trainable: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    state: dict,
    keep: int = 2,
    rng_states: list[dict] | None = None,
) -> Path:
    """Write checkpoint `step` under `folder` atomically and point `latest` at it; keep the newest `keep`.

    `rng_states` holds one `rng_state()` per process, by rank (default: this process's alone).

    An interrupted write leaves nothing behind: the partial folder is removed (now, or at the next save when
    the process was killed) and `latest` still names the previous checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".partial-step-*"):  # left by a killed process
        shutil.rmtree(stale, ignore_errors=True)
    final = folder / f"step-{step:07d}"
    partial = folder / f".partial-step-{step:07d}"
    pointer = folder / f".{LATEST}.tmp"
    try:
        partial.mkdir()
        _save_tensors({k: v.detach().cpu().contiguous() for k, v in named_trainable.items()},
                      partial / "trainable.safetensors")
        tensors, meta = _optimizer_to_files(optimizer)
        _save_tensors(tensors, partial / "optimizer.safetensors")
        (partial / "optimizer.json").write_text(json.dumps(meta))
        (partial / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
        for rank, rng in enumerate(rng_states if rng_states is not None else [rng_state()]):
            tensors_path, json_path = _rng_files(partial, rank)
            _save_tensors({k: v.detach().cpu().contiguous() for k, v in rng["tensors"].items()}, tensors_path)
            json_path.write_text(json.dumps(rng["json"]))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        pointer.write_text(final.name)
        os.replace(pointer, folder / LATEST)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        pointer.unlink(missing_ok=True)
        raise
    for old in _step_folders(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_problem(path: str | Path) -> str | None:
    """Why checkpoint folder `path` cannot be resumed from (a short phrase), or None when it is usable."""
    path = Path(path)
    if not path.is_dir():
        return "the folder is missing"
    for name in FILES:
        if not (path / name).is_file():
            return f"{name} is missing"
    for name in ["trainable.safetensors", "optimizer.safetensors"] + sorted(p.name for p in path.glob("rng-rank*.safetensors")):
        try:
            with safe_open(str(path / name), "pt"):  # checks the header and that the file is complete
                pass
        except Exception:  # safetensors raises its own SafetensorError (an Exception) or OSError
            return f"{name} is truncated or corrupt"
    for name, keys in (("optimizer.json", ("param_groups", "scalars")), ("state.json", ("step",))):
        try:
            content = json.loads((path / name).read_text())
        except (OSError, ValueError):  # ValueError covers bad JSON and bytes that are not text
            return f"{name} is not valid JSON"
        if not isinstance(content, dict) or any(key not in content for key in keys):
            return f"{name} lacks {', '.join(keys)}"
    return None


def find_checkpoint(folder: str | Path) -> tuple[Path | None, list[str]]:
    """The newest usable checkpoint under `folder` and, one phrase each, why newer ones were passed over.

    The one `latest` names comes first, then the `step-*` folders newest first. `(None, [])` means there is no
    checkpoint at all; `(None, reasons)` that there were some and none is usable.
    """
    folder = Path(folder)
    pointer = folder / LATEST
    steps = _step_folders(folder)[::-1]
    reasons, candidates = [], []
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (OSError, ValueError):
            name = ""
        if _STEP_NAME.fullmatch(name):
            candidates.append(folder / name)
        else:
            reasons.append(f"{LATEST} does not name a checkpoint")
    elif steps:
        reasons.append(f"{LATEST} is missing")
    candidates += [p for p in steps if p not in candidates]
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, reasons
        reasons.append(f"{path.name}: {problem}")
    return None, reasons


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest usable checkpoint under `folder`, or None."""
    return find_checkpoint(folder)[0]


def has_checkpoints(folder: str | Path) -> bool:
    """Whether `folder` holds any checkpoint (usable or not) or a `latest` pointer."""
    folder = Path(folder)
    return (folder / LATEST).exists() or bool(_step_folders(folder))


def parameter_mismatch(saved: dict[str, list], current: dict[str, list]) -> str | None:
    """How two `{name: shape}` tables differ (a short phrase), or None when they are the same."""
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or extra:
        return (f"{len(missing)} parameters are not in the checkpoint (e.g. {missing[:3]}) and "
                f"{len(extra)} of the checkpoint are not trained now (e.g. {extra[:3]})")
    reshaped = [name for name in current if list(saved[name]) != list(current[name])]
    if reshaped:
        name = reshaped[0]
        return (f"{len(reshaped)} parameters have other shapes, e.g. {name} is {list(saved[name])} in the "
                f"checkpoint and {list(current[name])} now (another LoRA rank or model?)")
    return None


def load_checkpoint(
    path: str | Path, named_trainable: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> dict:
    """Restore parameters and optimizer from checkpoint `path`; returns its `state.json`."""
    path = Path(path)
    saved = load_file(path / "trainable.safetensors")
    mismatch = parameter_mismatch({n: list(t.shape) for n, t in saved.items()},
                                  {n: list(p.shape) for n, p in named_trainable.items()})
    if mismatch:
        raise ValueError(
            f"checkpoint {path} does not match the parameters being trained: {mismatch}; resume with the same "
            "options as the interrupted run, or start a new output_dir"
        )
    with torch.no_grad():
        for name, parameter in named_trainable.items():
            parameter.copy_(saved[name])
    meta = json.loads((path / "optimizer.json").read_text())
    optimizer.load_state_dict(_optimizer_from_files(load_file(path / "optimizer.safetensors"), meta))
    return json.loads((path / "state.json").read_text())
