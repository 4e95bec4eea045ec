"""A layer's tiles shared out among threads (attngeom.extract.threads): every tile once, on
threads of one torch thread, under the caller's modes, errors raised in the caller; the
capture's results the same bits for any thread count."""

from __future__ import annotations

import threading
from dataclasses import fields

import pytest

torch = pytest.importorskip("torch", reason="needs torch")

from attngeom.extract.threads import share_out  # noqa: E402
from attngeom.extract.tiles import attention_summaries  # noqa: E402


def test_every_item_runs_once_on_threads_of_one_torch_thread():
    seen, lock = [], threading.Lock()

    def record(item):
        with lock:
            seen.append((item, threading.get_ident(), torch.get_num_threads(), torch.is_inference_mode_enabled()))

    caller = threading.get_ident()
    with torch.inference_mode():
        share_out(record, list(range(200)), 3)
    assert sorted(item for item, *_ in seen) == list(range(200))
    # The caller's own items keep its thread count; the pool's run on one torch thread.
    assert all(n == 1 for _, ident, n, _ in seen if ident != caller)
    assert all(inference for *_, inference in seen)


def test_one_thread_or_a_profiler_runs_every_item_in_the_caller():
    from torch.profiler import ProfilerActivity, profile

    idents = []
    share_out(lambda _: idents.append(threading.get_ident()), list(range(50)), 1)
    with profile(activities=[ProfilerActivity.CPU]):
        share_out(lambda _: idents.append(threading.get_ident()), list(range(50)), 4)
    assert set(idents) == {threading.get_ident()}


def test_an_error_in_a_pool_thread_is_raised_once_every_item_has_ended():
    ended, lock = [], threading.Lock()

    def fail_on_7(item):
        if item == 7:
            raise ValueError("tile 7")
        with lock:
            ended.append(item)

    with pytest.raises(ValueError, match="tile 7"):
        share_out(fail_on_7, list(range(100)), 2)
    assert 7 not in ended and len(ended) <= 99


@pytest.mark.parametrize("masked", [False, True])
def test_summaries_are_the_same_bits_on_any_number_of_threads(masked):
    torch.manual_seed(0)
    bsz, heads, kv, length, dim = 2, 8, 2, 150, 16
    q, k, v = torch.randn(bsz, heads, length, dim), torch.randn(bsz, kv, length, dim), torch.randn(bsz, kv, length, dim)
    mask = None
    if masked:  # a sliding window of 40 keys
        i = torch.arange(length)
        mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 40))[None, None]
    runs = [
        attention_summaries(q, k, v, mask, 0.3, keep_rows=True, queries=(3, 149), need_output=True, tile=(1, 17),
                            threads=threads)
        for threads in (1, 2, 5)
    ]
    (one, out), others = runs[0], runs[1:]
    for capture, output in others:
        assert torch.equal(output, out)
        for f in fields(one):
            want, got = getattr(one, f.name), getattr(capture, f.name)
            assert (want is None and got is None) or torch.equal(got, want), f.name


def test_threads_started_after_take_the_callers_thread_count():
    """torch keeps one thread count for threads yet to start: the pool's one thread each must
    not become every later thread's."""
    import attngeom.extract.threads as threads_module

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads_module._pool = None  # a pool started by this test
        share_out(lambda _: None, list(range(10)), 3)
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
