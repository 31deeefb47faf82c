"""The serve loop's callbacks (asyncflow/runtime/loops/serve.py), called as an engine's
``serve(pull, emit)`` calls them: the real host hands them to its engine, the simulator's
ServeWorker is a simulated engine that calls them (docs/architecture.md, "runtime/loops")."""
from __future__ import annotations

from asyncflow.compiler.pipeline import compile_file
from asyncflow.runtime.loops import Loop
from asyncflow.runtime.store import SampleStore


class _Control:
    def __init__(self):
        self.drops: list = []

    def note_drops(self, rows, reason) -> None:
        self.drops.append((list(rows), reason))


def _serving(slots: int = 4):
    plan = compile_file("pipelines/sim_longtail.yaml", sets=["step.steps=2"])
    wp = next(w for w in plan.workers if w.loop == "serve")
    store = SampleStore()
    for t in plan.tasks:
        store.register_task(t.name, list(t.inputs))
    spp = plan.step.samples_per_prompt
    groups = [g for g in range(8) for _ in range(spp)]
    store.add_rows({f: ["p"] * len(groups) for d in plan.data for f in d.fields}, groups)
    loop = Loop(plan, wp.id, store, _Control(), {"flush_s": 0.0, "backoff_s": 0.0})
    loop.start_serving(slots)
    return loop, store


def _done(r: int) -> dict:
    return {"_row": r, "_version": 0, "response": "ab", "logprobs": [-0.5, -0.25]}


def test_a_pull_fills_the_free_slots_and_those_its_cancels_free():
    loop, store = _serving()
    got = loop.serve_pull(4)
    rows = [int(r) for r in got["_row"]]
    assert len(rows) == 4 and "_cancel" not in got and loop.in_flight == 4
    # removed from the store while in flight: cancelled with the next pull, whose slot it frees
    store.drop([rows[0]], "filter")
    loop.heard_dropped([rows[0]], "filter")
    got = loop.serve_pull(0)
    assert got["_cancel"] == [rows[0]]
    assert len(got["_row"]) == 1 and int(got["_row"][0]) not in rows
    assert loop.in_flight == 4
    assert loop.serve_pull(0) == {}  # nothing more to cancel, no free slot


def test_emit_writes_each_sample_and_a_lease_ends_with_its_last_row():
    loop, store = _serving()
    rows = [int(r) for r in loop.serve_pull(4)["_row"]]
    (lease_id,) = loop.serving.leases
    store.drop([rows[0]], "filter")
    loop.heard_dropped([rows[0]], "filter")
    loop.serve_pull(0)
    loop.serve_emit(_done(rows[0]))  # cancelled while the engine finished it: never written
    assert loop.stats["rows"] == 0
    loop.serve_emit(_done(rows[1]))  # flush_s 0: written as it finishes
    assert loop.stats["rows"] == 1 and lease_id in loop.serving.leases
    for r in rows[2:]:
        loop.serve_emit(_done(r))
    assert loop.stats["rows"] == 3
    assert lease_id not in loop.serving.leases  # its rows all done or cancelled: it ended
    assert loop.in_flight == 1  # the row the cancel's slot took
