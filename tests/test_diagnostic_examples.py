"""Every diagnostic code has an example the tests walk.

The codes ``check`` and the compiler report (AF1xx-AF5xx) carry their examples in the table
itself (:class:`asyncflow.diagnostics.Example`), walked by
``compiler_tests/test_diagnostics_table.py``. The few that a file cannot show (an unreadable
file, a plug-in distribution) and every run-time code (AF6xx) have their example here: a small
reproduction through the narrowest real code path that raises the code -- a data source read, a
run directory claimed, a worker's contract check, a short in-process run on the local backend --
and the test asserts it produces exactly that code. Nothing is faked: where a condition needs the
machine to be otherwise (a cluster without GPUs, a process with one core) the example gives the
real function that decides it that machine's description.
"""
from __future__ import annotations

import dataclasses

import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncflow.compiler import compile_file
from asyncflow.diagnostics import Diagnostics, table
from asyncflow.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ROOT / "pipelines"
EXAMPLES = {}  # code -> fn(tmp_path, monkeypatch): its reproduction, raising the code


def example(code: str):
    def add(fn):
        assert code not in EXAMPLES, code
        EXAMPLES[code] = fn
        return fn
    return add


def codes_of(exc: BaseException) -> list[str]:
    """The codes an exception carries: a UserError's diagnostics, else its ``code`` (TaskError,
    RunError, the models' SourceError and PromptError)."""
    if isinstance(exc, UserError):
        return [d.code for d in exc.diagnostics]
    code = getattr(exc, "code", None)
    return [code] if code else []


def check_codes(path: Path, sets=()) -> list[str]:
    from asyncflow.check import check_file

    diags = Diagnostics()
    check_file(str(path), sets=sets, diags=diags)
    return [d.code for d in diags.items]


# -- AF1xx / AF2xx that no Example can hold -----------------------------------------------------
@example("AF100")
def unreadable_file(tmp_path, monkeypatch):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"pipeline: caf\xe9\n")
    return check_codes(bad)


@example("AF213")
def plugin_engine_without_args(tmp_path, monkeypatch):
    from asyncflow.engines.base import ENTRY_POINT_GROUP

    site = tmp_path / "site"
    dist = site / "myeng-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myeng\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmyeng = myeng_mod:Engine\n")
    (site / "myeng_mod.py").write_text("class Engine:\n    pass\n")
    monkeypatch.syspath_prepend(str(site))
    path = tmp_path / "p.yaml"
    path.write_text((PIPELINES / "grpo_digits.yaml").read_text().replace("engine: hf", "engine: myeng"))
    return check_codes(path)


# -- data sources (asyncflow.runtime.data) -----------------------------------------------------
def _data_pipeline(tmp_path, rows: str, extra: str = "") -> Path:
    (tmp_path / "rows.jsonl").write_text(rows)
    text = (PIPELINES / "sim_longtail.yaml").read_text()
    text = text.replace("source: asyncflow.datasets:digits", "source: rows.jsonl")
    text = text.replace("args: {n: 10000, seed: 0}", "args: {}")
    text = text.replace("fields: [prompt, answer]", "fields: [prompt, answer]" + extra)
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return p


def _load(path: Path):
    from asyncflow.runtime.data import load_prompts

    return load_prompts(compile_file(str(path)), warn=lambda msg: None)


ROW = '{"prompt": "1+1=", "answer": "2"}\n'
DATA = {"AF601": ROW + '{"prompt": \n', "AF602": "\n", "AF603": ROW + '{"prompt": "2+2="}\n',
        "AF605": ROW + '{"prompt": "2+2=", "answer": null}\n'}
for _code, _rows in DATA.items():
    example(_code)(lambda tmp_path, monkeypatch, rows=_rows: _load(_data_pipeline(tmp_path, rows)))


@example("AF606")
def too_few_prompts_for_the_epochs(tmp_path, monkeypatch):
    return _load(_data_pipeline(tmp_path, ROW * 5, "\n    epochs: 3"))


@example("AF607")
def a_split_the_directory_lacks(tmp_path, monkeypatch):
    from asyncflow.runtime.data import load_prompts

    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text(ROW)
    p = _data_pipeline(tmp_path, ROW)
    p.write_text(p.read_text().replace("source: rows.jsonl", "source: data"))
    plan = compile_file(str(p))
    # a plan.json edited by hand: its split is not there
    plan = dataclasses.replace(plan, data=[dataclasses.replace(plan.data[0], split="validation")])
    load_prompts(plan, warn=lambda msg: None)


# -- the cluster (asyncflow.runtime.placement, asyncflow.runtime.ray_connect) --------------------
def _gpu_plan():
    return compile_file(str(PIPELINES / "grpo_digits.yaml"), device_kind="gpu")


@example("AF604")
def a_pool_no_node_can_host(tmp_path, monkeypatch):
    from asyncflow.runtime.placement import check_feasible

    check_feasible(_gpu_plan(), [{"CPU": 8.0}])  # a cluster of one node without GPUs


@example("AF609")
def pools_larger_than_the_cluster(tmp_path, monkeypatch):
    from asyncflow.runtime.placement import check_feasible

    check_feasible(_gpu_plan(), [{"CPU": 8.0, "GPU": 1.0}])  # two pools of one GPU each


@example("AF608")
def an_address_where_nothing_listens(tmp_path, monkeypatch):
    from asyncflow.runtime.ray_connect import probe_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    probe_address(f"127.0.0.1:{port}", timeout=5)


@example("AF613")
def a_local_ray_that_does_not_start(tmp_path, monkeypatch):
    import ray

    from asyncflow.runtime.ray_connect import ensure_ray

    def init(*a, **kw):  # what Ray 2.60 raises when its node misses its fixed 30 s
        raise Exception("The current node timed out during startup. This could happen because "
                        "some of the raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray()


# -- a worker's contract (asyncflow.runtime.tasks, .contract) ----------------------------------
@example("AF610")
def a_reward_that_raises(tmp_path, monkeypatch):
    from asyncflow.runtime.tasks import runner_for

    (tmp_path / "boomfns.py").write_text(
        "def boom(prompt, answer, response):\n    raise ValueError('boom')\n")
    p = tmp_path / "p.yaml"
    p.write_text((PIPELINES / "sim_longtail.yaml").read_text().replace(
        "asyncflow.rewards:digits_match", "boomfns:boom"))
    task = compile_file(str(p)).task("score")
    runner_for(task, [str(tmp_path)])({"prompt": ["1+1="], "answer": ["2"], "response": ["2"]})


TASK = SimpleNamespace(name="gen", loc="p.yaml:30:3")


@example("AF611")
def an_output_left_out(tmp_path, monkeypatch):
    from asyncflow.runtime.contract import check_outputs

    check_outputs(TASK, {"completion": ["a", "b"]}, [("completion", "text"), ("lp", "token_floats")],
                  [7, 8])


@example("AF612")
def a_value_that_is_not_finite(tmp_path, monkeypatch):
    from asyncflow.runtime.contract import check_outputs

    check_outputs(TASK, {"reward": [1.0, float("nan")]}, [("reward", "float")], [7, 8])


# -- the run directory (asyncflow.runtime.rundir) ----------------------------------------------
def _sim_plan():
    return compile_file(str(PIPELINES / "sim_longtail.yaml"))


@example("AF620")
def resume_of_nothing(tmp_path, monkeypatch):
    from asyncflow.runtime import rundir

    rundir.claim(str(tmp_path / "missing"), _sim_plan(), resume=True, force=False)


@example("AF621")
def resume_of_a_changed_plan(tmp_path, monkeypatch):
    from asyncflow.runtime import rundir

    plan = _sim_plan()
    before = plan.to_dict()
    before["sync"][0]["max_staleness"] = 1  # the checkpoint was made with staleness 1
    (_checkpoint(tmp_path / "run", 1) / "plan.json").write_text(json.dumps(before))
    rundir.claim(str(tmp_path / "run"), plan, resume=True, force=False)


@example("AF622")
def out_into_a_run(tmp_path, monkeypatch):
    from asyncflow.runtime import rundir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / rundir.RUN_FILES[0]).write_text("{}")
    rundir.claim(str(tmp_path / "run"), _sim_plan(), resume=False, force=False)


@example("AF624")
def force_over_files_no_run_wrote(tmp_path, monkeypatch):
    from asyncflow.runtime import rundir

    (tmp_path / "run").mkdir()  # a user's own metrics.jsonl, and no manifest listing it
    (tmp_path / "run" / "metrics.jsonl").write_text("{}")
    rundir.claim(str(tmp_path / "run"), _sim_plan(), resume=False, force=True)


@example("AF623")
def two_runs_in_one_directory(tmp_path, monkeypatch):
    from asyncflow.runtime import rundir

    first = rundir.claim(str(tmp_path / "run"), _sim_plan(), resume=False, force=False)
    try:  # a lock is per open file: a second claim, even from this process, is refused
        rundir.claim(str(tmp_path / "run"), _sim_plan(), resume=False, force=True)
    finally:
        first.release()


# -- run-time faults (asyncflow.runtime.driver): short runs on the local backend, in process ----
# the shipped long-tail sim pipeline, shrunk: 8 prompts x 4 samples a step, tiny latencies
FAST = ["step.prompts_per_step=8", "step.samples_per_prompt=4",
        "tasks.generate.args.latency.median=0.005", "tasks.generate.args.latency.max=0.05",
        "tasks.update.args.seconds_per_sample=0.001"]


def _run(tmp_path, sets=(), path=PIPELINES / "sim_longtail.yaml", steps=4, **kw):
    from asyncflow.runtime.driver import Driver

    plan = compile_file(str(path), sets=list(sets), backend="local")
    return Driver(plan, "local", out_dir=str(tmp_path / "run"), steps=steps, **kw).run()


@example("AF630")
def a_hung_worker(tmp_path, monkeypatch):
    _run(tmp_path, FAST, inject=["hang@step1:score"], stall_timeout=1.0)


@example("AF631")
def a_death_past_max_restarts(tmp_path, monkeypatch):
    _run(tmp_path, FAST, inject=["kill@step1:generate/2"], max_restarts=0)


@example("AF632")
def a_lost_actor(tmp_path, monkeypatch):
    from asyncflow.runtime.driver import worker_error

    raise worker_error("generate/0", "StoreLost: the sample store's actor died", "")


@example("AF633")
def a_trainer_death_without_checkpoints(tmp_path, monkeypatch):
    _run(tmp_path, FAST, inject=["kill@step1:update"], max_restarts=3)  # the CLI's default


@example("AF634")
def a_bad_inject(tmp_path, monkeypatch):
    from asyncflow.runtime.driver import parse_inject

    parse_inject("melt@step1:generate", _sim_plan(), "local")


@example("AF635")
def a_refilling_filter_that_drops_everything(tmp_path, monkeypatch):
    (tmp_path / "dropall.py").write_text(
        "def nothing_passes(reward, groups):\n    return [False for _ in groups]\n")
    text = (PIPELINES / "sim_longtail.yaml").read_text().replace(
        "  advantage:\n", "  keep:\n    kind: filter\n    fn: dropall:nothing_passes\n"
        "    batched: true\n    refill: true\n    inputs: [reward]\n    outputs: [kept]\n"
        "  advantage:\n", 1).replace("    inputs: [reward]\n    outputs: [advantages]",
                                      "    inputs: [reward, kept]\n    outputs: [advantages]", 1)
    p = tmp_path / "p.yaml"
    p.write_text(text)
    _run(tmp_path, ["tasks.generate.replicas=1", "pools.rollout.devices=1", "step.prompts_per_step=2",
                    "step.samples_per_prompt=2", "tasks.generate.args.latency=0.0005",
                    "tasks.update.args.micro_batch=4", "sync.0.max_staleness=1"], path=p, steps=2)


@example("AF636")
def a_replica_0_that_never_comes(tmp_path, monkeypatch):
    from asyncflow.runtime import devices
    from asyncflow.runtime.control import Control

    devices.rendezvous(Control(), "update", 1, 0, use_ray=False, timeout=0.3)


@example("AF637")
def a_distributed_trainer_on_threads(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    _run(tmp_path, ["step.prompts_per_step=4", "sync.0.max_staleness=0", "pools.train.devices=2",
                    "tasks.update.args.micro_batch=16", "tasks.update.replicas=2"],
         path=PIPELINES / "grpo_digits_deepspeed.yaml", steps=1)


@example("AF638")
def a_trainer_gone_from_its_collective(tmp_path, monkeypatch):
    from asyncflow.runtime import collective
    from asyncflow.runtime.weights import Adopter

    monkeypatch.setattr(collective, "PEER_WAIT_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    desc = {"via": "collective", "host": "127.0.0.1", "port": port, "version": 1, "device": "cpu"}
    adopter = Adopter(None, ["policy"], False, vias={"policy": "collective"}, replica="generate/0")
    for _ in range(10_000):  # retried at each heartbeat until the peer wait is over
        adopter.adopt({"policy": (1, [{"collective": desc}])})


# -- asyncflow simulate (asyncflow.commands.simulate) ------------------------------------------
@example("AF640")
def simulate_with_no_cost(tmp_path, monkeypatch):
    from asyncflow.commands.simulate import run_one

    run_one(compile_file(str(PIPELINES / "grpo_digits.yaml")), 1)


@example("AF641")
def simulate_a_plan_that_cannot_finish(tmp_path, monkeypatch):
    from asyncflow.commands.simulate import run_one

    plan = _sim_plan()
    plan = dataclasses.replace(plan, workers=[w for w in plan.workers if w.task != "update"])  # nobody trains
    run_one(plan, 2)


@example("AF642")
def a_bad_sweep(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from asyncflow.commands import simulate
    from asyncflow.console import State

    app = typer.Typer()
    app.callback()(lambda: None)  # a group: the command keeps its name, as in asyncflow.cli
    simulate.register(app)
    r = CliRunner().invoke(app, ["simulate", str(PIPELINES / "sim_longtail.yaml"), "--sweep",
                                 "steps"], obj=State())
    raise r.exception


@example("AF643")
def calibrate_from_a_run_without_trace(tmp_path, monkeypatch):
    from asyncflow.commands.simulate import calibration_of

    (tmp_path / "plan.json").write_text(_sim_plan().to_json())  # no trace.json, no metrics
    calibration_of(str(PIPELINES / "sim_longtail.yaml"), [], str(tmp_path))


@example("AF644")
def calibrate_from_another_pipeline(tmp_path, monkeypatch):
    from asyncflow.commands.simulate import calibration_of

    (tmp_path / "plan.json").write_text(compile_file(str(PIPELINES / "dapo.yaml")).to_json())
    calibration_of(str(PIPELINES / "sim_longtail.yaml"), [], str(tmp_path))


# -- a model and its prompts (asyncflow.models, .lora, .engines.vllm) ---------------------------
def _spec(model: dict | None = None):
    from asyncflow.engines.base import EngineSpec

    model = model or {"name": "policy", "init": "asyncflow.models:tiny_decoder", "args": {}}
    return EngineSpec(task="generate", kind="rollout", model={**model, "loc": "p.yaml:6:11"},
                      extra={"task_loc": "p.yaml:9:3"})


@example("AF650")
def a_model_directory_gone_since_compile(tmp_path, monkeypatch):
    from asyncflow import models

    models.engine_load(_spec({"name": "policy", "init": "./ckpt", "source_kind": "directory",
                              "path": str(tmp_path / "ckpt")}))


CHAT = [{"role": "user", "content": "What is 2+3?"}]


@example("AF651")
def a_chat_for_a_tokenizer_without_a_template(tmp_path, monkeypatch):
    from asyncflow import models

    models.engine_prompt(_spec(), models.CharTokenizer(), CHAT)


@example("AF652")
def a_prompt_neither_text_nor_messages(tmp_path, monkeypatch):
    from asyncflow import models

    models.engine_prompt(_spec(), models.CharTokenizer(), {"a": 1})


@example("AF655")
def a_prompt_with_characters_the_tokenizer_cannot_encode(tmp_path, monkeypatch):
    from asyncflow import models

    models.engine_prompt(_spec(), models.CharTokenizer(), "What is 2+3? é", round_trip=True)


@example("AF656")
def a_chat_its_template_refuses(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from asyncflow import models

    fixture = Path(__file__).resolve().parents[1] / "compiler_tests" / "fixtures"
    tok = models.HFTokenizer(AutoTokenizer.from_pretrained(str(fixture / "strict_template_model")))
    models.engine_prompt(_spec(), tok, CHAT)


@example("AF657")
def a_prompt_longer_than_the_model_takes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncflow import models
    from asyncflow.engines.hf_serve import length_spec

    engine = SimpleNamespace(spec=_spec(), tokenizer=models.CharTokenizer(), args={},
                             max_positions=16, length_dist=length_spec(8))
    models.model_prompt(engine, "What is 12+34? And 5+6?")


@example("AF658")
def a_token_the_model_has_no_embedding_row_for(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncflow import models

    engine = SimpleNamespace(spec=_spec(), tokenizer=models.CharTokenizer(), args={},
                             vocab_rows=20)
    models.model_prompt(engine, "What is 12+34?")


@example("AF653")
def an_adapter_the_model_cannot_take(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from asyncflow import lora, models

    spec = _spec({"name": "policy", "init": "asyncflow.models:tiny_decoder", "args": {},
                  "lora": lora.resolve({"r": 4, "target_modules": ["qkv"]})})
    lora.wrap(models.tiny_decoder(layers=2, hidden=64)[0], spec, train=True)


@example("AF654")
def vllm_tensor_parallel_on_one_core(tmp_path, monkeypatch):
    from asyncflow.engines import vllm

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # this process
    vllm.bind_cpu_workers(_spec(), 2)


# -- asyncflow export (asyncflow.runtime.export) -----------------------------------------------
def _checkpoint(run_dir: Path, step: int, whole: bool = True, plan=None) -> Path:
    from asyncflow.runtime import checkpoint

    ck = Path(checkpoint.root(str(run_dir))) / f"step_{step}"
    engine = Path(checkpoint.engine_dir(str(ck), "update/0"))
    engine.mkdir(parents=True)
    (engine / "engine_state.json").write_text("{}")
    if whole:
        (ck / checkpoint.STATE_FILE).write_text(json.dumps({"version": step}))
    if plan is not None:
        (ck / "plan.json").write_text(json.dumps(plan.to_dict()))
    return ck


def _export(run_dir: Path, **kw):
    from asyncflow.runtime.export import export_run

    return export_run(str(run_dir), **kw)


@example("AF660")
def export_of_no_directory(tmp_path, monkeypatch):
    _export(tmp_path / "nowhere")


@example("AF661")
def export_of_a_run_without_checkpoints(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text(json.dumps(_sim_plan().to_dict()))
    _export(tmp_path / "run")


@example("AF662")
def export_of_an_unreadable_checkpoint(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "run", 2, whole=False)
    _export(tmp_path / "run")


@example("AF663")
def export_into_a_directory_in_use(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "run", 2, plan=_sim_plan())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    _export(tmp_path / "run", out=str(tmp_path / "mine"))


@example("AF664")
def export_of_a_run_whose_engine_saved_no_model(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "run", 2, plan=_sim_plan())  # the sim engine writes no config.json
    _export(tmp_path / "run")


# -- asyncflow run --log (asyncflow.runtime.loggers) -------------------------------------------
@example("AF670")
def a_logger_whose_library_is_not_installed(tmp_path, monkeypatch):
    from asyncflow.runtime import loggers

    monkeypatch.setitem(sys.modules, "mlflow", None)  # blocked: as if not installed
    loggers.make(["mlflow"], str(tmp_path))


@example("AF671")
def an_unknown_logger(tmp_path, monkeypatch):
    from asyncflow.runtime import loggers

    loggers.make(["wandbb"], str(tmp_path))


@example("AF672")
def a_logger_that_cannot_start(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from asyncflow.runtime import loggers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    loggers.make(["mlflow"], str(tmp_path), "run").start({})


# -- the walk ------------------------------------------------------------------------------------
def test_every_code_has_exactly_one_kind_of_example():
    """A code has examples in the table (walked by compiler_tests/test_diagnostics_table.py) or
    one here, never neither and never both."""
    in_table = {code for code, c in table().items() if c.examples}
    missing = sorted(set(table()) - in_table - set(EXAMPLES))
    assert not missing, f"codes without an example: {missing}"
    assert not sorted(in_table & set(EXAMPLES)), "a code with examples in the table and here"
    assert not sorted(set(EXAMPLES) - set(table())), "an example of a code the table lacks"


@pytest.mark.parametrize("code", sorted(EXAMPLES))
def test_example_produces_exactly_its_code(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        got = EXAMPLES[code](tmp_path, monkeypatch)
    except Exception as e:  # UserError, TaskError, RunError; the models' SourceError, PromptError
        got = codes_of(e)
        if not got:  # not a coded error: the example itself is broken
            raise
    assert got == [code], f"{code}: the example produced {got}"
