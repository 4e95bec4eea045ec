"""Corpora and windows: offline, with a whitespace tokenizer."""

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attngeom.errors import AttngeomError
from attngeom.extract.corpora import (
    Corpus,
    iter_windows,
    open_corpus,
    rebuild_wikitext_articles,
    select_windows,
)

BOS = 0


class WhitespaceTokenizer:
    """Word -> id, ids from 1 so that none collides with BOS."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab) + 1) for word in text.split()]


def toy_corpus(lengths: list[int]) -> Corpus:
    # Words are unique to their document, so any token names the document it came from.
    docs = [" ".join(f"d{d}w{w}" for w in range(n)) for d, n in enumerate(lengths)]
    return Corpus("toy", None, "0" * 64, lambda: docs)


def check_window(window, docs: list[str], tokenize, length: int) -> None:
    ids = tokenize(docs[window.doc_index])
    assert window.tokens.dtype == np.int32
    assert window.tokens.shape == (length,)
    assert window.tokens[0] == BOS
    assert 0 <= window.start <= len(ids) - (length - 1)
    assert window.tokens[1:].tolist() == ids[window.start:window.start + length - 1]


# --- WikiText article rebuild -------------------------------------------------

def test_rebuild_wikitext_articles_splits_on_level_one_headings_only():
    lines = [
        "",
        " = Alpha = \n",
        "",
        " Alpha text . \n",
        " = = Early life = = \n",
        " More alpha . \n",
        " = = = Deeper = = = \n",
        " Deepest alpha . \n",
        "",
        " = Beta = \n",
        " Beta text . \n",
    ]
    articles = list(rebuild_wikitext_articles(lines))
    assert len(articles) == 2
    assert articles[0].startswith("= Alpha =")
    assert "= = Early life = =" in articles[0] and "Deepest alpha" in articles[0]
    assert articles[1] == "= Beta = \n Beta text ."


def test_rebuild_wikitext_keeps_leading_text_and_drops_blank_articles():
    lines = [" stray text . \n", "", " = Alpha = \n", " a . \n", " = Empty = \n", " = Gamma = \n", "\n"]
    articles = list(rebuild_wikitext_articles(lines))
    assert articles == ["stray text .", "= Alpha = \n a .", "= Empty =", "= Gamma ="]
    assert list(rebuild_wikitext_articles(["", "\n"])) == []


# --- windows ------------------------------------------------------------------

def test_first_windows_are_bos_plus_document_prefix_and_skip_short_documents():
    lengths = [10, 3, 12, 5, 20]
    corpus = toy_corpus(lengths)
    docs = list(corpus.documents())
    tokenize = WhitespaceTokenizer()
    windows = list(iter_windows(corpus, tokenize, BOS, 9))
    assert [w.doc_index for w in windows] == [0, 2, 4]
    for window in windows:
        assert window.start == 0
        check_window(window, docs, tokenize, 9)


def test_select_windows_counts_all_usable_documents_when_short():
    corpus = toy_corpus([10, 3, 12, 5, 20])
    assert len(select_windows(corpus, WhitespaceTokenizer(), BOS, 9, 3)) == 3
    with pytest.raises(AttngeomError, match=r"toy has only 3 documents of at least 8 tokens .*asked for 4"):
        select_windows(corpus, WhitespaceTokenizer(), BOS, 9, 4)
    # None usable: fewer sequences would not help, so that is not offered.
    with pytest.raises(AttngeomError) as caught:
        select_windows(corpus, WhitespaceTokenizer(), BOS, 30, 1)
    assert str(caught.value) == ("toy has no document of at least 29 tokens with this tokenizer; use a shorter "
                                 "context length or another corpus")


def test_random_windows_are_reproducible_and_prefix_stable():
    corpus = toy_corpus([50, 2, 80, 64, 100, 40, 70])
    docs = list(corpus.documents())
    tokenize = WhitespaceTokenizer()
    few = select_windows(corpus, tokenize, BOS, 33, 3, rule="random", seed=7)
    many = select_windows(corpus, tokenize, BOS, 33, 6, rule="random", seed=7)
    for a, b in zip(few, many[:3]):
        assert (a.doc_index, a.start) == (b.doc_index, b.start)
        np.testing.assert_array_equal(a.tokens, b.tokens)
    for window in many:
        check_window(window, docs, tokenize, 33)
    other_seeds = [
        [w.start for w in select_windows(corpus, tokenize, BOS, 33, 6, rule="random", seed=s)] for s in range(5)
    ]
    assert len({tuple(starts) for starts in other_seeds}) > 1


def test_windows_never_mix_documents():
    corpus = toy_corpus([4, 4, 4, 30])
    tokenize = WhitespaceTokenizer()
    (window,) = select_windows(corpus, tokenize, BOS, 6, 1, rule="random", seed=3)
    words = {idx: word for word, idx in tokenize.vocab.items()}
    assert window.doc_index == 3
    assert all(words[idx].startswith("d3w") for idx in window.tokens[1:].tolist())


@pytest.mark.parametrize(
    "kwargs",
    [dict(length=1, count=1), dict(length=4, count=0), dict(length=4, count=1, rule="middle"),
     dict(length=4, count=1, seed=-1)],
)
def test_bad_window_arguments(kwargs):
    with pytest.raises(AttngeomError):
        select_windows(toy_corpus([10]), WhitespaceTokenizer(), BOS, **kwargs)


# --- local files --------------------------------------------------------------

def test_local_txt_jsonl_parquet_and_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("one whole file\nsecond line", encoding="utf-8")
    (tmp_path / "b" / "c.jsonl").write_text(
        json.dumps({"text": "row one", "id": 1}) + "\n\n" + json.dumps({"text": "row two"}) + "\n", encoding="utf-8"
    )
    pq.write_table(pa.table({"text": ["p0", "p1", "p2"], "n": [0, 1, 2]}), tmp_path / "b" / "d.parquet")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")

    assert list(open_corpus(str(tmp_path / "a.txt")).documents()) == ["one whole file\nsecond line"]
    assert list(open_corpus(str(tmp_path / "b" / "c.jsonl")).documents()) == ["row one", "row two"]
    assert list(open_corpus(str(tmp_path / "b" / "d.parquet")).documents()) == ["p0", "p1", "p2"]
    folder = open_corpus(str(tmp_path))
    assert folder.id == str(tmp_path.resolve()) and folder.split is None
    assert list(folder.documents()) == ["one whole file\nsecond line", "row one", "row two", "p0", "p1", "p2"]
    assert list(folder.documents()) == list(folder.documents())


def test_local_fingerprint_tracks_content(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("alpha beta", encoding="utf-8")
    first = open_corpus(str(path)).fingerprint
    assert len(first) == 64 and first == open_corpus(str(path)).fingerprint
    path.write_text("alpha gamma", encoding="utf-8")
    assert open_corpus(str(path)).fingerprint != first
    folder = open_corpus(str(tmp_path)).fingerprint
    (tmp_path / "more.txt").write_text("delta", encoding="utf-8")
    assert open_corpus(str(tmp_path)).fingerprint != folder


def test_local_bad_inputs(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(AttngeomError, match="no field 'text'.*body"):
        list(open_corpus(str(tmp_path / "rows.jsonl")).documents())
    assert list(open_corpus(str(tmp_path / "rows.jsonl"), text_field="body").documents()) == ["x"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(AttngeomError, match="no column 'text'"):
        list(open_corpus(str(tmp_path / "t.parquet")).documents())
    (tmp_path / "data.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(AttngeomError, match="unsupported file type"):
        open_corpus(str(tmp_path / "data.csv"))
    with pytest.raises(AttngeomError, match="no such file"):
        open_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AttngeomError, match="holds no"):
        open_corpus(str(tmp_path / "empty"))
    with pytest.raises(AttngeomError, match="no splits"):
        open_corpus(str(tmp_path / "rows.jsonl"), split="train")


# --- offline corpora ----------------------------------------------------------

@pytest.mark.needs_model
def test_wiki_summaries_offline():
    corpus = open_corpus("wiki-summaries")
    docs = list(corpus.documents())
    assert 9_000 <= len(docs) <= 11_000
    assert all(isinstance(doc, str) for doc in docs) and sum(bool(doc.strip()) for doc in docs) > 9_000
    assert sum(len(doc.split()) >= 127 for doc in docs) > 100
    again = open_corpus("wiki-summaries")
    assert again.fingerprint == corpus.fingerprint and next(again.documents()) == docs[0]
    assert len(corpus.fingerprint) == 64 and corpus.id == "wiki-summaries" and corpus.split is None


@pytest.mark.needs_model
def test_wiki_summaries_window_selection_is_fast():
    started = time.perf_counter()
    windows = select_windows(open_corpus("wiki-summaries"), WhitespaceTokenizer(), BOS, 128, 16)
    assert len(windows) == 16 and time.perf_counter() - started < 2


def test_python_docs_offline():
    corpus = open_corpus("python-docs")
    docs = list(corpus.documents())
    assert len(docs) >= 50 and all(doc.strip() for doc in docs)
    assert sum(len(doc.split()) >= 1_024 for doc in docs) >= 5
    assert docs == list(open_corpus("python-docs").documents()) and len(corpus.fingerprint) == 64


# --- hub ----------------------------------------------------------------------

@pytest.mark.needs_model
def test_unknown_dataset_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The libraries read the variable at import; another test may have imported them already.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    with pytest.raises(AttngeomError, match=r"^unknown dataset 'no-such-org/no-such-corpus-xyz': not an offline"):
        open_corpus("no-such-org/no-such-corpus-xyz")
    assert time.perf_counter() - started < 15


@pytest.mark.needs_model
def test_unreachable_hub_fails_fast_without_offline_mode(monkeypatch):
    def no_network():
        raise OSError("Name or service not known")

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_session", no_network)
    with pytest.raises(AttngeomError, match="unreachable.*HF_HUB_OFFLINE=1"):
        open_corpus("no-such-corpus-xyz")
    with pytest.raises(AttngeomError, match="could not load wikitext-103"):
        open_corpus("wikitext-103")
