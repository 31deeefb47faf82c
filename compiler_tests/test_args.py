"""Task args (asyncflow/argtable.py): the table covers every arg the engines read, agrees with
the loss and estimator configs, and ``check`` reports an unknown, mistyped or unaccepted arg at
its key (AF210-AF213), for built-in engines, user functions, env factories and plug-ins."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import argtable
from asyncflow.algos.config import AdvantageConfig, LossConfig
from asyncflow.argtable import (ENGINE_ARGS, ESTIMATOR_ARGS, GENERIC_ARGS, LOSS_ARGS, Arg,
                                declared, declared_args)
from asyncflow.check import check_file
from asyncflow.diagnostics import Diagnostics
from asyncflow.engines.base import BUILTIN, ENTRY_POINT_GROUP
from asyncflow.kinds import ESTIMATORS, LOSSES
from compiler_tests.conftest import PIPELINES, ROOT, position

ENGINES = ROOT / "asyncflow" / "engines"
# which engine's args each engine module reads (every module of asyncflow/engines is listed, so
# a new one cannot be missed); None: a module that reads no task args
MODULE_ENGINE = {"hf.py": "hf", "hf_serve.py": "hf", "torch_common.py": "hf", "multiturn.py": "hf",
                 "batching.py": None, "base.py": None, "__init__.py": None, "vllm.py": "vllm",
                 "deepspeed.py": "deepspeed", "sim.py": "sim", "sim_turns.py": "sim",
                 "sim_draws.py": "sim", "vllm_setup.py": "vllm", "hf_train.py": "hf",
                 "hf_state.py": "hf", "deepspeed_setup.py": "deepspeed"}
GRPO = (PIPELINES / "grpo_digits.yaml").read_text()


# -- the table cannot drift from the code --------------------------------------------------------
def _args_receiver(node: ast.AST) -> bool:
    """``args``, ``a`` (the engines' local name for ``self.args``), or ``<anything>.args``."""
    return (isinstance(node, ast.Name) and node.id in ("args", "a")) or (
        isinstance(node, ast.Attribute) and node.attr == "args")


def keys_read(path: Path) -> set[str]:
    """Every literal key read as ``args.get("k", ...)`` or ``args["k"]`` in ``path``."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and _args_receiver(node.func.value) and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and _args_receiver(node.value)
              and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
    return keys


def test_every_engine_module_is_mapped_to_its_engine():
    assert {p.name for p in ENGINES.glob("*.py")} == set(MODULE_ENGINE)
    assert set(ENGINE_ARGS) == set(BUILTIN)


@pytest.mark.parametrize("module", sorted(m for m, e in MODULE_ENGINE.items() if e))
def test_every_arg_an_engine_reads_is_declared(module):
    engine = MODULE_ENGINE[module]
    read = keys_read(ENGINES / module)
    # hf and deepspeed trainers read their loss settings through LossConfig.from_args(args)
    loss_fields = {f.name for f in dataclasses.fields(LossConfig)}
    names = {a.name for a in ENGINE_ARGS[engine]} | {a.name for a in GENERIC_ARGS}
    missing = sorted(read - names - (loss_fields if engine in ("hf", "deepspeed") else set()))
    assert not missing, f"{module} reads args the table does not declare for {engine}: {missing}"
    if module in ("hf.py", "hf_train.py", "vllm.py", "sim.py", "deepspeed.py",
                  "deepspeed_setup.py"):
        assert read, f"the scan found no args in {module}: has the way engines read them changed?"


def test_the_scan_sees_the_known_reads():
    assert {"micro_batch", "max_new_tokens", "slots"} <= keys_read(ENGINES / "hf.py")
    assert {"lr", "betas", "adam_eps", "max_grad_norm", "fp32_master"} <= keys_read(
        ENGINES / "hf_train.py")
    assert {"zero_stage", "ds_config"} <= keys_read(ENGINES / "deepspeed.py")
    assert {"master_port", "master_addr", "dist_timeout"} <= keys_read(
        ENGINES / "deepspeed_setup.py")
    assert {"env_threads", "max_turns"} <= keys_read(ENGINES / "sim_turns.py")


def test_the_compiler_reads_only_generic_or_engine_args():
    read = keys_read(ROOT / "asyncflow" / "compiler" / "passes" / "lower.py")
    # and a rollout's temperature: the plan's sampling settings (lower rule 9), which scorers
    # and trainers compute log-probs at
    assert read and read <= {a.name for a in GENERIC_ARGS} | {"slots", "temperature"}


def test_losses_declare_loss_config_fields_with_its_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(LossConfig)}
    assert set(LOSS_ARGS) == set(LOSSES)
    declared_somewhere = set()
    for loss, args in LOSS_ARGS.items():
        for a in args:
            assert a.name in fields, (loss, a.name)
            assert a.default == fields[a.name], (loss, a.name)
            declared_somewhere.add(a.name)
    assert declared_somewhere == set(fields)


def test_estimators_declare_exactly_the_settings_their_function_takes():
    from asyncflow.algos.advantages import FUNCTIONS

    fields = {f.name: f.default for f in dataclasses.fields(AdvantageConfig)}
    assert set(ESTIMATOR_ARGS) == set(ESTIMATORS) == set(FUNCTIONS)
    for name, fn in FUNCTIONS.items():
        takes = {p for p in inspect.signature(fn).parameters if p in fields}
        assert {a.name for a in ESTIMATOR_ARGS[name]} == takes, name
        assert all(a.default == fields[a.name] for a in ESTIMATOR_ARGS[name]), name


def test_every_arg_is_well_formed():
    every = [a for t in ENGINE_ARGS.values() for a in t] + list(GENERIC_ARGS) + [
        a for t in (*LOSS_ARGS.values(), *ESTIMATOR_ARGS.values()) for a in t]
    for a in every:
        assert a.type in argtable.TYPES and a.doc and "\n" not in a.doc, a
        assert set(a.kinds) <= set(argtable.ALL_KINDS), a
        assert (a.type == "choice") == bool(a.choices), a
        if a.default is not None:
            assert a.problem(a.default) is None, a  # a default fits its own type and bounds
    for engine, args in ENGINE_ARGS.items():
        names = [a.name for a in args]
        assert len(names) == len(set(names)), engine


def test_what_a_task_may_take():
    train = declared("train", "hf", loss="grpo")
    assert {"lr", "betas", "clip_eps", "kl_coef", "micro_batch"} <= set(train)
    assert "max_new_tokens" not in train and "clip_eps_high" not in train
    rollout = declared("rollout", "hf")
    assert {"max_new_tokens", "temperature", "top_p", "slots", "batch_size"} <= set(rollout)
    assert "lr" not in rollout and "micro_batch" not in rollout
    assert set(declared("advantage", estimator="gae")) >= {"gamma", "lam", "whiten", "batch_size"}
    assert "zero_stage" in declared("train", "deepspeed", loss="ppo")


def test_arg_problems():
    lr = declared("train", "hf", loss="grpo")["lr"]
    assert lr.problem(1e-3) is None
    assert lr.problem("fast") == ("AF211", "a number > 0")
    assert lr.problem(0.0) == ("AF361", "a number > 0")
    assert lr.problem(True)[0] == "AF211"  # a bool is not a number
    betas = declared("train", "hf", loss="grpo")["betas"]
    assert betas.problem([0.9, 0.99]) is None and betas.problem([0.9])[0] == "AF211"
    length = declared("rollout", "hf")["max_new_tokens"]
    assert length.problem({"dist": "lognormal"}) is None  # the distribution reader's (AF362)
    assert length.problem(0) == ("AF361", "an integer >= 1, or a distribution {dist: ...}")
    mgn = declared("train", "hf", loss="grpo")["max_grad_norm"]
    assert mgn.problem(None) is None  # null: clipping off


# -- check: located, coded, with a did-you-mean --------------------------------------------------
def diags_of(path: Path, sets=()) -> list:
    diags = Diagnostics()
    check_file(str(path), sets=sets, diags=diags)
    return diags.items


def edited(tmp_path: Path, old: str, new: str) -> tuple[str, Path]:
    """The GRPO pipeline with ``old`` replaced by ``new``, written to ``tmp_path/p.yaml``."""
    text = GRPO.replace(old, new)
    assert text != GRPO
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return text, path


def test_unknown_trainer_arg_is_located_at_its_key_with_a_suggestion(tmp_path):
    text, path = edited(tmp_path, "args: {lr: 1.0e-3,", "args: {lrate: 1.0e-3,")
    [d] = diags_of(path)
    assert d.code == "AF210" and (d.loc.line, d.loc.col) == position(text, "lrate")
    assert d.loc.end_col - d.loc.col == len("lrate")
    assert d.hint == "did you mean 'lr'?"
    assert "'update'" in d.message and "hf engine's train args" in d.message
    assert "grpo loss's" in d.message


def test_unknown_rollout_arg(tmp_path):
    text, path = edited(tmp_path, "max_new_tokens: 8", "max_tokens: 8")
    [d] = diags_of(path)
    assert (d.code, d.hint) == ("AF210", "did you mean 'max_new_tokens'?")
    assert (d.loc.line, d.loc.col) == position(text, "max_tokens")


def test_a_trainer_arg_on_a_rollout_is_unknown_there(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("max_new_tokens: 8", "max_new_tokens: 8, lr: 0.1"))
    assert [d.code for d in diags_of(path)] == ["AF210"]


def test_a_string_lr_is_a_wrong_type_at_its_key(tmp_path):
    text, path = edited(tmp_path, "lr: 1.0e-3", "lr: '1.0e-3'")
    [d] = diags_of(path)
    assert d.code == "AF211" and (d.loc.line, d.loc.col) == position(text, "lr: '")
    assert "must be a number > 0, not '1.0e-3'" in d.message


def test_a_bad_choice_and_a_bound(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("kl_coef: 0.001", "kl_coef: -1, kl_estimator: k9"))
    got = {d.code: d for d in diags_of(path)}
    assert set(got) == {"AF211", "AF361"}
    assert "one of k1, k2, k3" in got["AF211"].message
    assert "kl_coef" in got["AF361"].message


def test_a_loss_arg_of_another_loss_is_unknown(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("kl_coef: 0.001", "kl_coef: 0.001, tis_cap: 2.0"))
    [d] = diags_of(path)
    assert d.code == "AF210" and "tis_cap" in d.message
    path.write_text(GRPO.replace("kl_coef: 0.001", "kl_coef: 0.001, tis_cap: 2.0")
                        .replace("loss: grpo", "loss: tis"))
    assert diags_of(path) == []


def test_the_dsl_locates_the_key_too(tmp_path):
    text = (PIPELINES / "grpo_digits.af").read_text().replace("lr=", "lrate=")
    path = tmp_path / "p.af"
    path.write_text(text)
    [d] = diags_of(path)
    assert d.code == "AF210" and (d.loc.line, d.loc.col) == position(text, "lrate")


def test_a_set_override_is_located_in_the_override():
    [d] = diags_of(PIPELINES / "grpo_digits.yaml", sets=("tasks.update.args.lrate=0.1",))
    assert d.code == "AF210" and d.loc.file == "--set[1]"
    assert d.loc.col == len("tasks.update.args.") + 1


# -- user functions and env factories ---------------------------------------------------------
def _with_score_args(tmp_path: Path, source: str, args: str) -> tuple[Path, str]:
    (tmp_path / "grader.py").write_text(source)
    old = "    outputs: [reward]\n"
    assert GRPO.count(old) == 1
    text = GRPO.replace("fn: asyncflow.rewards:digits_match", "fn: grader:score").replace(
        old, f"{old}    args: {args}\n")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path, text


def test_a_function_arg_it_does_not_take_is_af212(tmp_path):
    src = "def score(prompt, answer, response, scale=1.0):\n    return scale\n"
    path, text = _with_score_args(tmp_path, src, "{scale: 2.0, scael: 3.0}")
    [d] = diags_of(path)
    assert d.code == "AF212" and d.hint == "did you mean 'scale'?"
    assert (d.loc.line, d.loc.col) == position(text, "scael")
    assert "grader:score" in d.message
    assert "grader" not in sys.modules  # read from source, never imported


def test_a_function_with_kwargs_takes_any_arg(tmp_path):
    src = "def score(prompt, answer, response, **kw):\n    return 1.0\n"
    path, _ = _with_score_args(tmp_path, src, "{anything: 1, batch_size: 4}")
    assert diags_of(path) == []


def test_the_compilers_args_are_checked_on_function_tasks_too(tmp_path):
    src = "def score(prompt, answer, response):\n    return 1.0\n"
    path, _ = _with_score_args(tmp_path, src, "{batch_size: four}")
    assert [d.code for d in diags_of(path)] == ["AF211"]


def test_env_factory_args(tmp_path):
    text = (PIPELINES / "agentic_multiturn.yaml").read_text()
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert diags_of(path) == []  # max_operand, stop_on_error: the factory's; max_turns: both
    bad = text.replace("max_operand: 4", "max_operands: 4")
    assert bad != text
    path.write_text(bad)
    [d] = diags_of(path)
    assert d.code == "AF210" and d.hint == "did you mean 'max_operand'?"
    assert "env asyncflow.envs:" in d.message


# -- plug-in engines --------------------------------------------------------------------------
def _plugin(tmp_path: Path, monkeypatch, body: str, name: str = "myeng") -> None:
    site = tmp_path / "site"
    dist = site / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {name}_mod:Engine\n")
    (site / f"{name}_mod.py").write_text("raise RuntimeError('imported!')\n" + body)
    monkeypatch.syspath_prepend(str(site))


def _on_engine(tmp_path: Path, engine: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("engine: hf", f"engine: {engine}"))
    return path


def test_a_plugin_declares_its_args_in_source(tmp_path, monkeypatch):
    _plugin(tmp_path, monkeypatch, "from asyncflow.argtable import Arg\nclass Engine:\n"
            "    ARGS = (Arg('max_new_tokens', 'int', 16, 'length', kinds=('rollout',), min=1),\n"
            "            Arg('temperature', 'num', 1.0, 't'), Arg('lr', 'num', 1e-4, 'lr'))\n")
    path = _on_engine(tmp_path, "myeng")
    assert diags_of(path) == []
    assert "myeng_mod" not in sys.modules
    path.write_text(GRPO.replace("engine: hf", "engine: myeng").replace("lr: 1.0e-3", "lrate: 1"))
    assert [(d.code, d.hint) for d in diags_of(path)] == [("AF210", "did you mean 'lr'?")]
    path.write_text(GRPO.replace("engine: hf", "engine: myeng").replace("max_new_tokens: 8",
                                                                        "max_new_tokens: 0"))
    assert [d.code for d in diags_of(path)] == ["AF361"]


def test_a_plugin_without_args_is_not_checked_and_check_says_so_once(tmp_path, monkeypatch):
    _plugin(tmp_path, monkeypatch, "class Engine:\n    pass\n")
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("engine: hf", "engine: myeng").replace("lr: 1.0e-3", "lrate: 1"))
    items = diags_of(path)
    assert [(d.code, d.severity) for d in items] == [("AF213", "warning")]  # 3 tasks, said once
    assert "class Engine has no ARGS" in items[0].message


def test_unreadable_args_declarations():
    assert isinstance(declared_args("os:path"), str)
    assert declared_args("asyncflow_no_such_module:Engine") .startswith("no Python source")


def test_the_example_plugin_declares_its_args():
    example = ROOT / "examples" / "custom_engine"
    got = declared_args("asyncflow_echo_engine:EchoEngine", [str(example)])
    assert got == (Arg("max_new_tokens", "int", 16, "cuts the echoed text", kinds=("rollout",),
                       min=1),)
    sys.path.insert(0, str(example))
    try:
        import asyncflow_echo_engine

        assert asyncflow_echo_engine.EchoEngine.ARGS == got  # what import sees, check read
    finally:
        sys.path.remove(str(example))
        sys.modules.pop("asyncflow_echo_engine", None)


# -- the CLI --------------------------------------------------------------------------------------
def test_cli_check_fails_on_lrate_with_exit_2(tmp_path):
    text = GRPO.replace("lr: 1.0e-3", "lrate: 1.0e-3")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS="200", NO_COLOR="1"))
    assert r.returncode == 2, r.stderr
    line, col = position(text, "lrate")
    assert f"{path}:{line}:{col}: AF210 task 'update' has no arg 'lrate'" in r.stderr
    assert "hint: did you mean 'lr'?" in r.stderr and "Traceback" not in r.stderr


# -- docs/language.md and the JSON Schema list the table ------------------------------------------
def test_the_reference_lists_every_arg():
    from asyncflow.langdoc import args_section

    text = "\n".join(args_section())
    for engine, args in ENGINE_ARGS.items():
        section = text.split(f"### Engine `{engine}`")[1].split("###")[0]
        assert all(f"| `{a.name}` |" in section for a in args), engine
    for a in [*GENERIC_ARGS, *(a for t in (*LOSS_ARGS.values(), *ESTIMATOR_ARGS.values())
                               for a in t)]:
        assert f"| `{a.name}` |" in text, a.name


def test_the_schema_describes_every_engines_args_without_closing_them():
    import jsonschema
    import yaml

    from asyncflow.schema import json_schema

    schema = json_schema()
    rules = schema["$defs"]["task"]["allOf"]
    for key, table in (("engine", ENGINE_ARGS), ("loss", LOSS_ARGS), ("estimator", ESTIMATOR_ARGS)):
        for name, args in table.items():
            got = [r["then"]["properties"]["args"]["properties"] for r in rules
                   if r["if"]["properties"].get(key, {}).get("const") == name]
            assert (got[0].keys() if got else set()) == {a.name for a in args}, (key, name)
    v = jsonschema.Draft202012Validator(schema)
    doc = yaml.safe_load(GRPO)
    doc["tasks"]["score"]["args"] = {"anything": 1}  # a fn's keywords: open
    assert not list(v.iter_errors(doc))
    doc["tasks"]["update"]["args"]["lr"] = "fast"
    doc["tasks"]["generate"]["args"]["max_new_tokens"] = 0
    assert len(list(v.iter_errors(doc))) == 2
