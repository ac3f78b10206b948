"""Benchmarks that run over several sittings: each part keeps its result beside the settings that decided it.

A part (a distilled model, a sweep variant) lives in its own folder. `start_part` writes the settings it runs with
(`settings.json`) before anything else, so a rerun can tell an interrupted part of the same settings (continued),
one of other settings (started afresh) and a folder the benchmark never wrote (refused, left as it is). A finished
part's record goes to `result.json` with its settings; `read_json` gives it back for the caller to compare.
Smaller results that need no folder, such as the teacher's measurements, are kept by `kept`.
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
