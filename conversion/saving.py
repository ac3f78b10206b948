"""Writing model folders so that an interrupted write never leaves a folder that looks complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def atomic_save(save: Callable[[Path], object], folder: str | Path) -> Path:
    """Run `save(temporary_folder)`, then rename it to `folder` (replacing an older one) only once it completed.

    The temporary folder is a hidden sibling (`.partial-NAME`), removed if `save` raises.
    """
    folder = Path(folder)
    partial = folder.with_name(f".partial-{folder.name}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder


def save_model_and_tokenizer(model, tokenizer, folder: str | Path) -> None:
    """`save_pretrained` of the model (safetensors, custom code) and, when there is one, of the tokenizer."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
