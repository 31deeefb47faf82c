"""A trainer's heartbeat rides on its step report (asyncflow/runtime/control.py report_step,
asyncflow/runtime/worker.py): one control call a step instead of two on Ray, and each step's
utilization of the train pool is the trainer's busy time as of that step's end, whatever
reports one collect of the driver brings; and the workers of one Ray actor process send their
heartbeats together (Worker.carriable, Control.sync's ``others``)."""
from __future__ import annotations

from asyncflow.runtime.control import Control
from asyncflow.runtime.driver.metrics import StepBook

from test_runtime_props import make_plan


def test_a_step_report_carries_its_workers_heartbeat():
    c = Control()
    c.note_drops([4, 5], "filter")
    span = {"name": "COMPUTE", "worker": "update/0"}
    reply = c.report_step("update", {"step": 0}, ("update/0", [span], {"busy": 1.5}, {}))
    assert reply["stop"] is False and reply["dropped"] == [([4, 5], "filter")]
    got = c.collect()
    assert got["busy"] == {"update/0": 1.5} and got["spans"] == [span]
    assert got["reports"] == [("update", {"step": 0})]
    # each removal is told once, by whichever heartbeat comes first
    assert c.sync("update/0", [], {"busy": 2.0}, {})["dropped"] == []
    c.stop()
    assert c.report_step("update", {"step": 1}, ("update/0", [], {"busy": 2.0}, {}))["stop"]
    assert c.report_step("update", {"step": 2}) is None  # no heartbeat: nothing to answer


class _Store:
    def stats(self):
        return {"tasks": {t: {"ready": 0} for t in ("generate", "score", "advantage", "update")}}


def _report(step: int, end: float, busy: float) -> dict:
    return {"step": step, "version": step + 1, "end": end, "rows": [], "staleness": [],
            "metrics": {}, "busy": {"update/0": busy}}


def test_each_steps_utilization_is_its_own_reports_busy():
    plan = make_plan(1, 1, 3)
    book = StepBook(plan, ["update"], 0, "update", 0.0, {})
    # one collect brings two steps' reports; its busy integrals are the newest (after step 1)
    book.take_reports([("update", _report(0, 1.0, 0.8)), ("update", _report(1, 2.0, 1.2))])
    c = {"busy": {"update/0": 1.2}, "exposed": {}, "stats": {}}
    rows = [book.row(s, reps, c, _Store(), 0.0, 0) for s, reps in book.complete_steps()]
    # step 0: 0.8 s busy of its 1.0 s; step 1: 0.4 s of its 1.0 s -- not 1.2 and 0
    assert [r["utilization"]["train"] for r in rows] == [0.8, 0.4]


def test_without_a_reported_busy_the_collects_is_used():
    plan = make_plan(1, 1, 3)
    book = StepBook(plan, ["update"], 0, "update", 0.0, {})
    rep = _report(0, 2.0, 0.0)
    del rep["busy"]
    book.take_reports([("update", rep)])
    c = {"busy": {"update/0": 1.0}, "exposed": {}, "stats": {}}
    [row] = [book.row(s, reps, c, _Store(), 0.0, 0) for s, reps in book.complete_steps()]
    assert row["utilization"]["train"] == 0.5


def test_a_sync_carries_the_heartbeats_of_its_process_neighbours():
    # Ray: the workers of one actor process that take no weights and report no rewards have
    # their busy time and spans carried by a neighbour's sync (asyncflow/runtime/worker.py
    # Worker.carriable); each is told its own stop flag and removed rows
    c = Control()
    c.sync("advantage/0", [], {"busy": 0.1, "stats": {"rows": 8}, "exposed_s": 0.0}, {})
    c.note_drops([8, 9], "filter")
    span = {"name": "COMPUTE", "worker": "advantage/0"}
    reply = c.sync("score/0", [], {"busy": 0.5}, {},
                   others=[("advantage/0", [span], {"busy": 0.3})])
    assert reply["dropped"] == [([8, 9], "filter")]
    assert reply["others"] == {"advantage/0": {"stop": False, "dropped": [([8, 9], "filter")]}}
    got = c.collect()
    assert got["busy"] == {"advantage/0": 0.3, "score/0": 0.5} and got["spans"] == [span]
    assert got["stats"]["advantage/0"] == {"rows": 8}  # what a carried beat lacks stays
    again = c.sync("advantage/0", [], {"busy": 0.4}, {})
    assert again["dropped"] == [] and "others" not in again  # told once
