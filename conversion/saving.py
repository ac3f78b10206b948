"""Writing model folders so that an interrupted write never leaves a folder that looks complete."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_save(save: Callable[[Path], object], folder: str | Path) -> Path:
    """Run `save(staging_folder)`, then move the result to `folder` only once `save` completed.

    The staging folder is a hidden sibling (`.NAME.partial-XXXX`), removed if `save` raises. An older `folder` is
    moved aside first and deleted only after the new one is in place, so it is restored if the move fails.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    retired = None
    try:
        save(staging)
        if folder.exists():
            retired = folder.with_name(f".{folder.name}.old-{staging.name.rsplit('-', 1)[-1]}")
            folder.rename(retired)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if retired is not None and not folder.exists():
            retired.rename(folder)
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    return folder


def save_model_and_tokenizer(model, tokenizer, folder: str | Path) -> None:
    """`save_pretrained` of the model (safetensors, custom code) and, when there is one, of the tokenizer."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
