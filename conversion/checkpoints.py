"""Training checkpoints: safetensors only, written atomically, resumable.

A checkpoint folder `checkpoints/step-000123/` holds
* `trainable.safetensors`: the parameters being trained (by name),
* `optimizer.safetensors` + `optimizer.json`: the optimizer's tensors and the rest of its state dict,
* `state.json`: step, tokens seen, the scheduler's state and anything the caller adds.
It is written under a temporary name and renamed when complete; `checkpoints/latest` names the newest
complete one. No pickle is written or read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"


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


def save_checkpoint(
    folder: str | Path,
    step: int,
    named_trainable: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    state: dict,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` under `folder` atomically and point `latest` at it; keep the newest `keep`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:07d}"
    partial = folder / f".partial-step-{step:07d}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in named_trainable.items()}, partial / "trainable.safetensors")
    tensors, meta = _optimizer_to_files(optimizer)
    save_file(tensors, partial / "optimizer.safetensors")
    (partial / "optimizer.json").write_text(json.dumps(meta))
    (partial / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    pointer = folder / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, folder / LATEST)
    complete = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    pointer = Path(folder) / LATEST
    if not pointer.is_file():
        return None
    path = Path(folder) / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(
    path: str | Path, named_trainable: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> dict:
    """Restore parameters and optimizer from checkpoint `path`; returns its `state.json`."""
    path = Path(path)
    saved = load_file(path / "trainable.safetensors")
    if set(saved) != set(named_trainable):
        missing, extra = sorted(set(named_trainable) - set(saved)), sorted(set(saved) - set(named_trainable))
        raise ValueError(
            f"checkpoint {path} does not match the parameters being trained (missing {missing[:5]}, "
            f"unexpected {extra[:5]}); resume with the same options as the interrupted run"
        )
    with torch.no_grad():
        for name, parameter in named_trainable.items():
            parameter.copy_(saved[name])
    meta = json.loads((path / "optimizer.json").read_text())
    optimizer.load_state_dict(_optimizer_from_files(load_file(path / "optimizer.safetensors"), meta))
    return json.loads((path / "state.json").read_text())
