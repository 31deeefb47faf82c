"""FlatWeights (asyncflow/runtime/weights.py): a state dict crosses Ray's object store as one
byte buffer and comes back equal, writable and independent of the buffer."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from asyncflow.runtime.weights import FlatWeights


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    return {
        "a.weight": w,
        "a.t": w.t(),  # not contiguous
        "b.bias": torch.randn(7, generator=g, dtype=torch.float64),
        "c.half": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "d.steps": torch.tensor(12345678901, dtype=torch.int64),  # 0-dim
        "e.mask": torch.tensor([True, False, True]),
        "f.empty": torch.empty(0, 4),
    }


def test_round_trip_is_exact_for_every_dtype_and_shape():
    state = _state()
    flat = FlatWeights.pack(state)
    assert flat is not None and flat.buf.dtype == np.uint8
    back = pickle.loads(pickle.dumps(flat, protocol=5)).unpack()  # as the object store moves it
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k


def test_unpacked_tensors_are_writable_and_do_not_share_the_buffer():
    state = _state()
    flat = FlatWeights.pack(state)
    flat.buf.setflags(write=False)  # the object store hands out a read-only buffer
    back = flat.unpack()
    back["a.weight"].add_(1.0)  # would fault on a view of read-only memory
    assert torch.equal(flat.unpack()["a.weight"], state["a.weight"])
    assert not np.shares_memory(back["b.bias"].numpy(), flat.buf)


def test_packing_copies_so_later_training_does_not_change_what_was_published():
    state = {"w": torch.zeros(4)}
    flat = FlatWeights.pack(state)
    state["w"].add_(1.0)
    assert torch.equal(flat.unpack()["w"], torch.zeros(4))


@pytest.mark.parametrize("weights", [None, {}, {"w": [1.0, 2.0]}, "weights", {"w": 1.0}])
def test_what_is_not_a_state_dict_of_cpu_tensors_is_sent_as_it_is(weights):
    assert FlatWeights.pack(weights) is None


def test_every_tensor_starts_aligned():
    flat = FlatWeights.pack(_state())
    assert all(off % FlatWeights.ALIGN == 0 for _, _, _, off, _ in flat.table)


def test_packing_never_imports_torch():
    """A sim trainer's weights are not tensors: publishing them must not import torch (seconds
    of CPU in a process that never needed it)."""
    import subprocess
    import sys

    code = ("import sys; from asyncflow.runtime.weights import FlatWeights, box_weights; "
            "assert FlatWeights.pack({'w': [1.0]}) is None; box_weights({'w': 1}, False); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
