"""The simulator's one-thread VStore (``threads=False``): the same reads as a locked one, and a
read that would wait for another thread's write is an error instead of a hang."""
import pytest

from asyncflow.runtime.store.common import StoreError
from asyncflow.simulate.vstore import VStore


def _store(threads: bool) -> VStore:
    s = VStore(lease_s=100.0, clock=lambda: 0.0, threads=threads)
    s.register_task("t", ["x"])
    s.add_rows({"x": [1, 2, 3, 4]}, [0, 0, 1, 1])
    return s


def test_one_thread_store_reads_like_a_locked_one():
    a, b = _store(True), _store(False)
    for kw in ({"n": 2}, {"n": 3, "min_rows": 3}, {"n": 2, "max_row": 3}):
        la, lb = a.get("t", **kw), b.get("t", **kw)
        assert (la is None) == (lb is None)
        if la is not None:
            assert la.rows == lb.rows and la.columns == lb.columns
    assert a.pending("t") == b.pending("t")


def test_one_thread_store_refuses_to_wait():
    s = _store(False)
    assert s.get("t", 4, min_rows=4) is not None
    assert s.get("t", 1) is None  # no wait: nothing now
    with pytest.raises(StoreError, match="one-thread"):
        s.get("t", 1, timeout=1.0)
