"""Benchmarks that run over several sittings: each part keeps its result beside the settings that decided it.

A part (a distilled model, a sweep variant) lives in its own folder. `start_part` writes the settings it runs with
(`settings.json`) before anything else, so a rerun can tell an interrupted part of the same settings (continued),
one of other settings (started afresh) and a folder the benchmark never wrote (refused, left as it is). A finished
part's record goes to `result.json` with its settings; `read_json` gives it back for the caller to compare.
Smaller results that need no folder, such as the teacher's fine-tuning speed, are kept by `kept`, and
measurements that take long one by one (a passkey length, a decode context) by a `PointStore`. A part that converts
its own student saves `conversion_options` among its settings, so that a change of `convert`'s defaults (the gate)
converts and trains it again instead of reusing a model made the old way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

#: the first file a part writes in its folder: the settings it runs with
SETTINGS_FILE = "settings.json"
#: a finished part's record, with the settings that decided it
RESULT_FILE = "result.json"


def as_saved(settings: dict) -> dict:
    """`settings` as they read back from JSON (tuples as lists, paths as strings), so they compare equal to saved ones."""
    return json.loads(json.dumps(settings, default=str))


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, record: dict) -> None:
    """Write `record` to `path` atomically (a kill leaves the old file or the new one, never half of one)."""
    from delta_attention.conversion.saving import write_text_atomically

    write_text_atomically(path, json.dumps(record, indent=1, default=str))


def conversion_options(settings) -> dict:
    """What decides a converted model, as saved: every field of `settings` (a `ConversionSettings`, `convert`'s
    defaults included) and the log-decay floor its gate gets."""
    import dataclasses

    from delta_attention.conversion.converter.target_config import log_decay_floor

    return as_saved({**dataclasses.asdict(settings), "log_decay_floor": log_decay_floor(settings.gate)})


def converted_options(folder: Path) -> dict | None:
    """`conversion_options` of the conversion in `folder`, read from its `conversion.json` and `config.json`; None
    where either is missing (no finished conversion there)."""
    record, config = read_json(folder / "conversion.json"), read_json(folder / "config.json")
    if record is None or config is None:
        return None
    return {**record["settings"], "log_decay_floor": config.get("linear_log_decay_floor")}


def option_changes(found: dict, wanted: dict) -> str:
    """The options of `wanted` that `found` holds with other values, as `KEY FOUND there, WANTED now` joined by
    `; ` (empty when none differs)."""
    return "; ".join(f"{key} {found.get(key)!r} there, {value!r} now" for key, value in wanted.items()
                     if found.get(key) != value)


def kept(path: Path, settings: dict, compute: Callable[[], dict], name: str) -> dict:
    """The record saved in `path` under these `settings` (as `as_saved` gives them), or else `compute()`'s record,
    saved there with them first."""
    record = read_json(path)
    if record is not None and record.get("settings") == settings:
        print(f"{name}: reused from {path.name}")
        return record
    record = {"settings": settings, **compute()}
    write_json(path, record)
    return record


class PointStore:
    """Measurements of one model kept one by one in a JSON file, each under the settings that decide it.

    `get(kind, settings, compute)` gives the value saved for (`kind`, `settings`), or computes it and saves it at
    once, so a run killed in its tenth measurement keeps the nine before, and a rerun asking for one more point
    (another passkey length, a longer decode context) measures that point only. The file belongs to `owner` (what
    the points are of: a model's settings); points saved for another owner are dropped. With `path` None the
    points live in memory only. Values come back as they read from JSON (dict keys as strings)."""

    def __init__(self, path: Path | None, owner: dict):
        record = read_json(path) if path is not None else None
        self.path, self.owner = path, as_saved(owner)
        self.points = record["points"] if record is not None and record.get("owner") == self.owner else {}

    def get(self, kind: str, settings: dict, compute: Callable[[], object]):
        """The value of point (`kind`, `settings`), computed by `compute()` only when none is saved."""
        key = json.dumps([kind, as_saved(settings)], sort_keys=True)
        if key not in self.points:
            self.points[key] = as_saved(compute())
            if self.path is not None:
                write_json(self.path, {"owner": self.owner, "points": self.points})
        return self.points[key]


def start_part(place: Path, settings: dict) -> bool:
    """Ready `place` for a part that runs with `settings`; returns whether an interrupted run of the same settings
    is there to continue.

    A folder that holds none of `settings.json`, `result.json` and a distillation run folder (`run/`, with the
    marker `distill` writes) was not written by the benchmark: it is refused (`FileExistsError`) and left as it is.
    One started with other settings (or by a version that kept no settings) is cleared, so the part starts afresh."""
    from delta_attention.conversion.output_folder import RUN_MARKER

    if place.exists():
        started = read_json(place / SETTINGS_FILE)
        ours = (place / RESULT_FILE).is_file() or (place / "run" / RUN_MARKER).is_file()
        if started is None and not ours:
            raise FileExistsError(f"{place} holds no {SETTINGS_FILE}, so this benchmark did not write it; nothing "
                                  "was changed. Move it away, or give another --output_dir")
        if started != settings:
            print(f"{place.name}: its settings changed since it ran; starting it afresh")
            shutil.rmtree(place)
    continuing = place.exists()
    if continuing:
        print(f"{place.name}: continuing its interrupted run")
    place.mkdir(parents=True, exist_ok=True)
    write_json(place / SETTINGS_FILE, settings)
    return continuing
