"""Writing model folders so that an interrupted write never leaves a folder that looks complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .output_folder import make_private_folder_public, sigterm_raises, swap_in, user_umask


def atomic_save(save: Callable[[Path], object], folder: str | Path) -> Path:
    """Run `save(staging_folder)`, then move the result to `folder` only once `save` completed.

    The staging folder is a hidden sibling (`.NAME.partial-XXXX`), removed if `save` raises or the process is
    interrupted (Ctrl-C or SIGTERM). An older `folder` is moved aside first and deleted only after the new one is
    in place, so it is restored if the move fails. The folder gets the permissions of the user's umask.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_raises():
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        try:
            make_private_folder_public(staging)
            save(staging)
            swap_in(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return folder


def write_text_atomically(path: str | Path, text: str) -> Path:
    """`write_bytes_atomically` of `text` in UTF-8."""
    return write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a hidden sibling of a name of its own (`.NAME.XXXX.partial`) renamed into
    place once written: a reader never sees half a file, and processes writing the same file at once (data
    parallel workers) never write into each other's. The file gets the permissions of the user's umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.chmod(partial, 0o666 & ~user_umask())  # mkstemp makes 0600 files
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return path


def save_model_and_tokenizer(model, tokenizer, folder: str | Path) -> None:
    """`save_pretrained` of the model (safetensors, custom code) and, when there is one, of the tokenizer."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
