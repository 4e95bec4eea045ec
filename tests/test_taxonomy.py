"""Head taxonomy (docs/method.md#head-taxonomy): votes, tie rules, rows vs winners, GQA, sliding windows, tables."""

from __future__ import annotations

import dask.array as da
import numpy as np
import xarray as xr
from click.testing import CliRunner
from conftest import extract

from attngeom.analyze import taxonomy_tables
from attngeom.analyze import taxonomy
from attngeom.analyze.blocks import _votes_variables
from attngeom.api import analyze
from attngeom.cli import main
from attngeom.extract.request import ExtractRequest
from attngeom.store import SIGNATURE_VARIABLES, open_dataset
from attngeom.store.session import StoreSession


def _votes_from_rows_block(rows, values, *, head_kv):
    """Full rows (1,1,H,Q,K) and values (1,1,KV,K,D) -> vote counts (1,1,H,3)."""
    winner = taxonomy.winners_from_rows(rows[0, 0], values[0, 0], head_kv)
    return taxonomy.query_votes(winner)[None, None]


def _vote_blocks(ds: xr.Dataset) -> da.Array:
    """Lazy (seq, layer, head, vote) query-vote counts: from the full rows and values when
    the run kept them (``--store-rows all``), else from the stored winners."""
    if "attn" in ds:
        return da.blockwise(
            _votes_from_rows_block, "slhv",
            ds["attn"].data, "slhqk", ds["values"].data, "slgkd",
            new_axes={"v": 3}, concatenate=True, dtype=np.int64, head_kv=ds["head_kv"].values,
        )
    winner = ds["winner"].data
    return da.map_blocks(taxonomy.query_votes, winner, chunks=winner.chunks[:3] + ((3,),), dtype=np.int64)


def votes_dataset(ds: xr.Dataset) -> xr.Dataset:
    """Lazy (seq, layer, head, vote) query-vote counts (docs/method.md#head-taxonomy) and each sequence's label.

    From the full rows and values when the run kept them (``--store-rows all``), else from
    the stored winners.
    """
    return _votes_variables(_vote_blocks(ds).rechunk({1: -1}), ds)


def brute_label(winner_rows: np.ndarray) -> int:
    """Algorithm 1 for one head, straight from the paper: winner_rows (seq, Q)."""
    sequence_labels = []
    for row in winner_rows:
        counts = [0, 0, 0]
        for i in range(1, len(row)):  # query 0 is excluded
            counts[0 if row[i] == i else 1 if row[i] == 0 else 2] += 1
        best = max(counts)
        sequence_labels.append(counts.index(best) if counts.count(best) == 1 else 2)
    counts = [sequence_labels.count(k) for k in range(3)]
    best = max(counts)
    return counts.index(best) if counts.count(best) == 1 else 2


def test_votes_and_labels_match_brute_force_on_random_winners():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_seq, q = rng.integers(1, 5), rng.integers(2, 7)
        # Mostly 0 or the diagonal, so that ties are frequent.
        choice = rng.integers(0, 3, size=(n_seq, q))
        query = np.arange(q)
        other = rng.integers(0, q, size=(n_seq, q)) % (query + 1)
        winner = np.where(choice == 0, query, np.where(choice == 1, 0, other))
        labels = taxonomy.plurality(taxonomy.query_votes(winner))
        assert taxonomy.head_regimes(labels[:, None])[0] == brute_label(winner)


def test_tie_rules_and_query_zero():
    # Query 0 votes for nothing even though j* = 0 = i there.
    assert taxonomy.query_votes(np.array([0, 1, 2, 0])).tolist() == [2, 1, 0]
    # A tie inside a sequence (one diagonal, one sink vote) is Other.
    assert taxonomy.plurality(taxonomy.query_votes(np.array([0, 1, 0]))) == taxonomy.OTHER
    # Sequences Diagonal and Sink: a tie across sequences is Reset.
    labels = np.array([taxonomy.DIAGONAL, taxonomy.SINK])[:, None]
    assert taxonomy.regime_names(taxonomy.head_regimes(labels)).tolist() == ["Reset"]
    # Two Diagonal sequences and one Sink: Retriever.
    labels = np.array([0, 1, 0])[:, None]
    assert taxonomy.regime_names(taxonomy.head_regimes(labels)).tolist() == ["Retriever"]


def test_known_regimes_from_synthetic_attention():
    """Rows built so that head 0 retrieves the current token, head 1 sinks, head 2 mixes
    elsewhere; head 3 has the largest attention on the sink but a near-zero sink value, so
    the value-norm weighting makes it Diagonal."""
    q = k = 8
    rows = np.full((4, q, k), 0.0)
    for i in range(q):
        rows[:, i, : i + 1] = 0.1 / (i + 1)
        rows[0, i, i] += 0.9
        rows[1, i, 0] += 0.9
        rows[2, i, i // 2] += 0.9
        rows[3, i, 0] += 0.6
        rows[3, i, i] += 0.3
    values = np.ones((2, k, 3))
    values[1, 0] = 1e-3  # kv head 1's sink value is tiny
    head_kv = np.array([0, 0, 1, 1])
    winner = taxonomy.winners_from_rows(rows, values, head_kv)
    labels = taxonomy.plurality(taxonomy.query_votes(winner))
    assert taxonomy.regime_names(labels).tolist() == ["Retriever", "Mixer", "Reset", "Retriever"]
    # With head 3 mapped to kv head 0 (a normal sink value) it becomes a Mixer: GQA matters.
    winner = taxonomy.winners_from_rows(rows, values, np.array([0, 0, 1, 0]))
    assert taxonomy.regime_names(taxonomy.plurality(taxonomy.query_votes(winner)))[3] == "Mixer"


def test_rows_and_winners_agree_and_sliding_window_hides_the_sink(tiny_model_dir, word_corpus, tmp_path):
    store = tmp_path / "s.zarr"
    extract(ExtractRequest(model=str(tiny_model_dir("gemma3")), dataset=str(word_corpus), context_length=16,
                           num_sequences=4, store=str(store), run_id="r", store_rows="all", progress=False))
    ds = xr.open_zarr(str(store), group="runs/r", consolidated=False)
    ds = ds.assign_coords(seq=("seq", np.arange(ds.sizes["seq"])))
    from_rows = votes_dataset(ds).compute()
    from_winner = votes_dataset(ds.drop_vars("attn")).compute()
    assert from_rows.attrs["source"] == "attn rows and values"
    np.testing.assert_array_equal(from_rows["sequence_label"].values, from_winner["sequence_label"].values)
    assert (np.abs(from_rows["votes"] - from_winner["votes"]) <= 1).all()  # float16 rows: rare near-ties
    # Sliding layers (window 6): queries i >= 6 cannot see the sink, so at most 5 sink votes.
    sink_votes = from_winner["votes"].sel(vote="sink")
    assert int(sink_votes.sel(layer=0).max()) <= 5
    assert int(sink_votes.sel(layer=2).max()) <= 5

    analyze(str(store), scheduler="threads", n_grid=[1, 4], progress=False)
    session = StoreSession.reading(str(store))
    heads = open_dataset(session.zstore, session.url, "runs/r/analysis/heads")
    expected = [[brute_label(ds["winner"].values[:, layer, h]) for h in range(4)] for layer in range(3)]
    assert heads["regime"].values.tolist() == taxonomy.regime_names(np.array(expected)).tolist()
    fractions = heads["vote_diagonal"] + heads["vote_sink"] + heads["vote_other"]
    np.testing.assert_allclose(fractions.values, 1.0)
    signatures = open_dataset(session.zstore, session.url, "runs/r/analysis/signatures")
    assert set(signatures["regime"].values) == {"Retriever", "Mixer", "Reset"}
    assert int(signatures["heads"].isel(n=0).sum()) == 12


def test_signatures_average_heads_of_each_regime():
    per_head = xr.Dataset(
        {name: (("layer", "head", "n"), np.arange(8.0).reshape(1, 4, 2) + i) for i, name in enumerate(SIGNATURE_VARIABLES)},
        coords={"n": [1, 2]},
    )
    regime = xr.DataArray(np.array([["Mixer", "Mixer", "Reset", "Mixer"]], dtype=object), dims=("layer", "head"))
    out = taxonomy.signatures_dataset(per_head, regime)
    np.testing.assert_allclose(out["s_norm"].sel(regime="Mixer").values, [(0 + 2 + 6) / 3, (1 + 3 + 7) / 3])
    np.testing.assert_allclose(out["s_norm_median"].sel(regime="Mixer").values, [2, 3])
    assert np.isnan(out["s_norm"].sel(regime="Retriever").values).all()
    assert out["heads"].sel(regime="Reset").values.tolist() == [1, 1]


def test_distribution_and_cross_corpus_tables():
    a = np.array([["Mixer", "Reset"], ["Retriever", "Mixer"]], dtype=object)
    b = np.array([["Mixer", "Mixer"], ["Retriever", "Mixer"]], dtype=object)
    labels = {"m__wiki": ("m", "wiki", a), "m__docs": ("m", "docs", b), "other": ("o", "wiki", a)}
    rows = {r["run"]: r for r in taxonomy_tables.distribution(labels)}
    assert rows["m__wiki"]["Mixer"] == 2 and rows["m__wiki"]["Mixer_pct"] == 50.0
    (pair,) = taxonomy_tables.cross_corpus(labels)
    assert pair["datasets"] == "docs - wiki"
    assert pair["Mixer_pp"] == 25.0 and pair["Reset_pp"] == -25.0 and pair["agreement"] == 0.75
    assert "agreement" in taxonomy_tables.format_tables(labels)


def test_taxonomy_command_needs_an_analyzed_run(tmp_path):
    from attngeom.extract.synthetic import write_synthetic_run

    store = str(tmp_path / "s.zarr")
    write_synthetic_run(store, "syn", n_seq=2, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, length=8)
    result = CliRunner().invoke(main, ["taxonomy", "--store", store])
    assert result.exit_code == 2 and "run 'attngeom analyze" in result.stderr
    analyze(store, scheduler="threads", n_grid=[1, 2], progress=False)
    result = CliRunner().invoke(main, ["taxonomy", "--store", store])
    assert result.exit_code == 0 and "synthetic" in result.output and "Retriever" in result.output
