"""The placement pass (asyncflow/compiler/passes/placement.py); rule numbers from its docstring.

The pipelines are asyncflow.diagnostics.examples.BASE with changes:

    prompts -> generate -> score -> advantage -> update      pools: rollout {generate}
                  \\-> ref (frozen) ------------------^             train   {ref, update}
    update ..sync..> generate
"""
import copy

import pytest
import yaml

from asyncflow.compiler import Context, compile_text
from asyncflow.compiler.passes.placement import placement
from asyncflow.diagnostics.examples import BASE
from asyncflow.errors import UserError


def src(**change):
    d = yaml.safe_load(BASE)
    for path, v in change.items():
        cur = d
        keys = path.split("__")
        for k in keys[:-1]:
            cur = cur[k]
        cur[keys[-1]] = v
    return yaml.safe_dump(d, sort_keys=False)


def placed(text, kind="auto"):
    return compile_text(text, "t.yaml", stop_after="placement", device_kind=kind, verify=True)


def test_cpu_by_default_gpu_on_request_rule_1():
    """Rule 1: auto -> CPU slots (no engine needs a GPU); gpu -> {"GPU": 1, "CPU": 1} bundles."""
    g = placed(src())
    assert g.g.graph["placement"]["device_kind"] == "CPU"
    assert g.g.graph["placement"]["pools"]["train"]["bundles"] == [{"CPU": 1}]
    g = placed(src(), "gpu")
    assert g.g.graph["placement"]["pools"]["train"]["bundles"] == [{"GPU": 1, "CPU": 1}]


def test_auto_picks_gpu_for_vllm_rule_1():
    g = placed(src(tasks__generate__engine="vllm"))
    assert g.g.graph["placement"]["device_kind"] == "GPU"


def test_pool_resources_added_to_every_bundle_rule_1():
    g = placed(src(pools__rollout={"devices": 2, "resources": {"accel_a100": 1}}), "gpu")
    assert g.g.graph["placement"]["pools"]["rollout"]["bundles"] == [
        {"GPU": 1, "CPU": 1, "accel_a100": 1}] * 2


def test_replicas_take_consecutive_bundles_rule_2():
    """Rule 2: replica r of a 2-device replica takes bundles [2r, 2r+2).

        pool rollout (4 devices): generate/0 -> [0, 1], generate/1 -> [2, 3]
    """
    g = placed(src(pools__rollout={"devices": 4}, tasks__generate__replicas=2,
                   tasks__generate__devices_per_replica=2))
    w = g.meta("generate")["workers"]
    assert [x["bundles"] for x in w] == [[0, 1], [2, 3]]
    assert [x["id"] for x in w] == ["generate/0", "generate/1"]


def test_colocated_tasks_time_share_rule_3():
    """Rule 3: ref (logprob) before update (train) on pool train, each asking for half a device."""
    g = placed(src())
    assert g.g.graph["placement"]["pools"]["train"]["tasks"] == ["ref", "update"]
    assert g.meta("ref")["time_share"] == 0 and g.meta("update")["time_share"] == 1
    assert g.meta("update")["workers"][0]["resources"] == {"CPU": 0.5}
    assert g.meta("update")["bundles"] == [0] == g.meta("ref")["bundles"]


def test_time_share_order_by_kind_not_source_order_rule_3():
    """update written before ref still runs after it."""
    d = yaml.safe_load(BASE)
    d["tasks"] = {"update": d["tasks"].pop("update"), **d["tasks"]}
    g = placed(yaml.safe_dump(d, sort_keys=False))
    assert g.g.graph["placement"]["pools"]["train"]["tasks"] == ["ref", "update"]


def test_pool_less_tasks_are_cpu_workers_rule_4():
    g = placed(src(tasks__score__replicas=3))
    w = g.meta("score")["workers"]
    assert [x["id"] for x in w] == ["score/0", "score/1", "score/2"]
    assert all(x["bundles"] == [] and x["resources"] == {"CPU": 0} for x in w)


def test_infeasible_placement_is_af401_not_a_crash_rule_2():
    """Placement alone (validate may report it first under its own code): AF401 at `replicas`.

        pool rollout (1 device) <- generate x3
    """
    text = src(tasks__generate__replicas=3)
    g = compile_text(text, "t.yaml", stop_after="build IR")
    ctx = Context()
    out = placement(g, ctx)
    assert [d.code for d in ctx.diags.errors] == ["AF401"]
    assert out.meta("generate")["workers"] == []
    with pytest.raises(UserError):
        compile_text(text, "t.yaml")


def test_reserved_resource_af402_rule_5():
    with pytest.raises(UserError) as e:
        compile_text(src(pools__train={"devices": 1, "resources": {"GPU": 2}}), "t.yaml")
    assert [d.code for d in e.value.diagnostics] == ["AF402"]


def _procs(text) -> dict:
    """process -> its workers, from the compiled plan."""
    plan = compile_text(text, "t.yaml")
    out: dict = {}
    for w in plan.workers:
        out.setdefault(w.process, []).append(w.id)
    return out


def test_workers_time_sharing_a_device_share_a_process_rule_6():
    """Rule 6: one process per device set of a pool; pool-less tasks' replica r in cpu:r.

        train (1 device): ref/0 + update/0 -> train:0     rollout (1): generate/0 -> rollout:0
        score x2, advantage x1 (no pool)   -> cpu:0 {score/0, advantage/0}, cpu:1 {score/1}
    """
    procs = _procs(src(tasks__score__replicas=2))
    assert procs == {"rollout:0": ["generate/0"], "cpu:0": ["score/0", "advantage/0"],
                     "cpu:1": ["score/1"], "train:0": ["ref/0", "update/0"]}


def test_multi_device_replicas_name_their_devices_rule_6():
    """generate x2 of 2 devices each on a 4-device pool: rollout:0-1 and rollout:2-3."""
    procs = _procs(src(pools__rollout={"devices": 4}, tasks__generate__replicas=2,
                       tasks__generate__devices_per_replica=2))
    assert procs["rollout:0-1"] == ["generate/0"] and procs["rollout:2-3"] == ["generate/1"]


def test_share_process_false_gives_each_worker_its_own_rule_6():
    procs = _procs(src(pools__train={"devices": 1, "share_process": False}))
    assert procs["ref/0"] == ["ref/0"] and procs["update/0"] == ["update/0"]
    assert procs["rollout:0"] == ["generate/0"]  # the other pool keeps the default


def test_share_process_must_be_a_bool():
    with pytest.raises(UserError) as e:
        compile_text(src(pools__train={"devices": 1, "share_process": "sometimes"}), "t.yaml")
    assert e.value.diagnostics and e.value.diagnostics[0].loc.line > 0


def test_plan_without_processes_loads_as_one_process_per_worker():
    """A plan written before rule 6 (no ``process``) still loads: each worker on its own."""
    from asyncflow.plan import Plan

    d = compile_text(src(), "t.yaml").to_dict()
    for w in d["workers"]:
        del w["process"]
    plan = Plan.from_dict(d)
    assert all(w.process == "" for w in plan.workers)
