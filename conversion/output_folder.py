"""Output folders: the one rule for where `convert`, `distill` and `finetune` may write, and how they replace.

* A new or empty folder is used as it is.
* An existing folder is continued with `--resume` (run folders) or replaced with `--overwrite`, and only when this
  tool wrote it (a run folder with `RUN_MARKER`, a converted/distilled model folder, or a run folder from before
  the marker existed); a folder of anything else needs `--force_overwrite` as well.
* The current directory, the home folder, the file-system root and any folder holding one of the command's
  inputs are never replaced.
* Everything is checked (`check_output_folder`) before any model or data is loaded, and a replacement happens
  only at the end: a replacing run works in a staging sibling (`.NAME.overwrite`) and swaps it in when complete
  (`RunFolder.finish`), so a failed or interrupted run leaves the old folder as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import torch

#: written at the top of every run folder of `distill` and `finetune`
RUN_MARKER = "delta_attention_run.json"
#: what a run folder written before `RUN_MARKER` existed holds
_LEGACY_RUN_ENTRIES = ("stage1", "stage2", "checkpoints", "adapter", "metrics.jsonl", "results.json")


def user_umask() -> int:
    """The process umask (read without changing it for longer than two calls)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_private_folder_public(folder: Path) -> None:
    """`tempfile.mkdtemp` creates 0700 folders; give a staging folder the permissions the user's umask asks for."""
    os.chmod(folder, 0o777 & ~user_umask())


def written_by_this_tool(folder: Path) -> bool:
    """Whether `folder` is a run folder or model folder that delta-attention wrote (so it may be replaced)."""
    folder = Path(folder)
    if (folder / RUN_MARKER).is_file() or (folder / "conversion.json").is_file():
        return True
    config = folder / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type") == "delta"
        except (OSError, ValueError, AttributeError):
            return False
    if (folder / "adapter_config.json").is_file():
        return False
    entries = {p.name for p in folder.iterdir()}
    return len(entries & set(_LEGACY_RUN_ENTRIES)) >= 2 and entries <= set(_LEGACY_RUN_ENTRIES) | {
        "metrics.png", ".results.json.partial", "model", "merged"}


def _is_same_or_inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _check_writable(folder: Path, flag: str) -> None:
    """Fail now, before any work, when `folder` could not be created or written."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise NotADirectoryError(f"{flag} {folder}: {existing} is a file, so no folder can be created under it")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise PermissionError(
            f"{flag} {folder}: cannot write in {existing} ({error.strerror or error}); choose a writable location"
        ) from None


def check_output_folder(out, *, overwrite: bool = False, resume: bool = False, force: bool = False,
                        inputs: tuple = (), flag: str = "--output_dir") -> Path:
    """Check that `out` may be written by a command with these options; nothing is created or changed.

    `inputs` are the paths the command reads (model folders, data files): the output may not contain them.
    Returns `out` as a `Path`.
    """
    if out is None or str(out).strip() == "":
        raise ValueError(f"give an output folder ({flag} DIR)")
    out = Path(out).expanduser()
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    protected = {cwd: "the current directory", Path.home().resolve(): "your home folder",
                 Path(resolved.anchor): "the file-system root"}
    if resolved in protected or _is_same_or_inside(cwd, resolved):
        what = protected.get(resolved, "a parent of the current directory")
        raise ValueError(f"{flag} {out} is {what}; give a new folder for the output, e.g. {flag} ./out")
    for item in inputs:
        if item is None:
            continue
        source = Path(item).expanduser()
        if source.exists() and _is_same_or_inside(source.resolve(), resolved):
            raise ValueError(f"{flag} {out} would replace the input {item}; write the output to another folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{flag} {out} is a file, not a folder; give a folder path")
    if out.is_dir() and any(out.iterdir()):
        if not (overwrite or resume):
            hint = "pass --resume to continue that run or --overwrite to replace it" if flag == "--output_dir" \
                else "pass --overwrite to replace it"
            raise FileExistsError(f"{flag} {out} already exists; {hint}")
        if not force and not written_by_this_tool(out):
            raise FileExistsError(
                f"{flag} {out} exists and was not written by delta-attention (no {RUN_MARKER}, conversion.json or "
                "delta config.json); nothing was changed. Choose another folder"
                + (", or pass --force_overwrite with --overwrite to replace it anyway" if overwrite else "")
            )
    _check_writable(out, flag)
    return out


@dataclasses.dataclass
class RunFolder:
    """Where a `distill`/`finetune` run writes (`work`) and where its result ends up (`final`).

    `work` is `final` unless the run replaces an existing folder: then it is the staging sibling `.NAME.overwrite`,
    swapped in by `finish()`.
    """

    final: Path
    work: Path

    @property
    def replacing(self) -> bool:
        return self.work != self.final

    def finish(self) -> Path:
        """Put a replacing run in place of the old folder (atomically: the old one is removed only afterwards)."""
        if self.replacing:
            swap_in(self.work, self.final)
            self.work = self.final
        return self.final


def staging_for(final: Path) -> Path:
    return final.with_name(f".{final.name}.overwrite")


def open_run_folder(out: Path, command: str, *, overwrite: bool, resume: bool) -> RunFolder:
    """Create (or reopen) the run folder after every input has been checked and loaded.

    With `overwrite` and an existing non-empty `out`, the run goes to the staging sibling: a stale one left by an
    interrupted replacing run is continued with `resume` and started afresh otherwise.
    """
    out = Path(out)
    work = out
    if overwrite and out.is_dir() and any(out.iterdir()):
        work = staging_for(out)
        if work.exists() and not resume:
            if not (work / RUN_MARKER).is_file():
                raise FileExistsError(f"{work} exists and was not written by delta-attention; remove it yourself")
            shutil.rmtree(work)
        elif work.exists():
            print(f"continuing the interrupted replacement run in {work}")
    elif resume and not (out / RUN_MARKER).is_file() and staging_for(out).is_dir():
        work = staging_for(out)
        print(f"continuing the interrupted replacement run in {work}")
    work.mkdir(parents=True, exist_ok=True)
    marker = work / RUN_MARKER
    if not marker.is_file():
        from delta_attention import __version__

        marker.write_text(json.dumps({"command": command, "version": __version__}, indent=1) + "\n")
    return RunFolder(out, work)


def open_run_folder_once(out: Path, command: str, *, overwrite: bool, resume: bool) -> RunFolder:
    """`open_run_folder` in the main process once every process has checked the output folder; the others get
    its result (under `accelerate launch` each process runs this pipeline)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState(cpu=not torch.cuda.is_available())  # as the training loop: gloo on CPU-only machines
    state.wait_for_everyone()
    holder = [open_run_folder(out, command, overwrite=overwrite, resume=resume) if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(holder)
    return holder[0]


def on_main_process(function, *args, **kwargs) -> None:
    """Run `function` (a write to the run folder) in the main process only, then let every process go on together:
    under `accelerate launch` each process runs this pipeline, and two writers of one folder would race."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # as the training loop: gloo on CPU-only machines
    if state.is_main_process:
        function(*args, **kwargs)
    state.wait_for_everyone()


def swap_in(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` is moved aside first, restored if the rename fails, and
    deleted only once `new` is in place."""
    retired = None
    if final.exists():
        retired = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(retired)
    try:
        new.rename(final)
    except BaseException:
        if retired is not None and not final.exists():
            retired.rename(final)
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def sigterm_raises():
    """Inside this block SIGTERM raises `SystemExit(143)` (like Ctrl-C raises KeyboardInterrupt), so cleanup code
    runs; outside the main thread, or when someone else already handles SIGTERM, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, None):
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = [
    "RUN_MARKER",
    "RunFolder",
    "check_output_folder",
    "on_main_process",
    "open_run_folder",
    "open_run_folder_once",
    "sigterm_raises",
    "written_by_this_tool",
]
