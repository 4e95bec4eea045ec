"""How a rerun differs from its run, in words: one comparison for what the names tell before
anything loads and for the whole identity once the model and the corpus are read."""

from attngeom.extract.identity import differences

RECORD = {
    "model": {"id": "m", "path": "/m", "file_sha256": "aa"},
    "dataset": {"id": "/c", "split": None, "fingerprint": "ff", "text_field": "text"},
    "context_length": 16, "window_rule": {"rule": "first", "seed": 0}, "bos_token_id": 1,
    "values_dtype": "float32", "store_rows": "last", "compute_dtype": "float32",
}


def test_the_names_compare_the_model_and_corpus_by_id_and_a_local_corpus_by_its_documents():
    named = {"model": {"id": "m"}, "dataset": {"id": "/c", "text_field": "text", "fingerprint": "ff"},
             "context_length": 16, "queries": [], "values_dtype": None}
    assert differences(RECORD, named) == []  # a run before --queries kept none: "last"
    assert differences(RECORD, {**named, "model": {"id": "n"}}) == ["--model is m in the run, n here"]
    assert differences(RECORD, {**named, "dataset": {"id": "/c", "text_field": "body", "fingerprint": "ff"}}) == [
        "--text-field is text in the run, body here"]
    assert differences(RECORD, {**named, "dataset": {"id": "/c", "text_field": "text", "fingerprint": "00"}},
                       {"dataset": "c"}) == ["the documents of --dataset c changed since the run read them"]
    assert differences(RECORD, {**named, "queries": [3, 7, 11, 15], "window_rule": {"rule": "random", "seed": 3}},
                       {"queries": "every:4"}) == [
        "--window is first in the run, random --seed 3 here", "--queries is last in the run, every:4 here"]


def test_the_whole_identity_names_other_weights_and_another_bos_token():
    full = {**RECORD, "queries": []}
    assert differences(RECORD, full) == []
    assert differences(RECORD, {**full, "model": {**RECORD["model"], "file_sha256": "bb"}}) == [
        "the weights of model m differ from those the run was extracted from"]
    assert differences(RECORD, {**full, "bos_token_id": 2}) == ["the BOS token is id 1 in the run, 2 here (--bos-token)"]
    assert differences({k: v for k, v in RECORD.items() if k != "compute_dtype"}, full) == [
        "--dtype is None in the run, float32 here"]
