"""A custom engine plugs in by entry point, without editing asyncflow (DESIGN.md, Engines).

The example package ``examples/custom_engine`` registers ``echo`` in the ``asyncflow.engines``
entry-point group. Rather than pip-installing it (which would change the shared venv and needs a
working pip), the fixture writes what an install writes -- a ``*.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` -- into a temporary folder and puts that folder and the
example's source folder on ``sys.path``; ``importlib.metadata`` finds both there.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.check import check_file
from asyncflow.engines.base import (ENTRY_POINT_GROUP, EngineSpec, Rollout, Scorer, Trainer,
                                    engine_names, load_engine_class)
from asyncflow.errors import UserError
from asyncflow.tokens import Text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_engine"
PIPELINE = EXAMPLE / "pipeline.yaml"
MODULE = "asyncflow_echo_engine"


def _entry_point_line() -> str:
    """The ``echo = ...`` line of the example's pyproject.toml (the single source of truth)."""
    import tomllib

    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"][ENTRY_POINT_GROUP]
    return "".join(f"{name} = {target}\n" for name, target in eps.items())


@pytest.fixture
def plugin_path(tmp_path):
    """A folder holding the example's dist-info, as ``pip install`` would write it."""
    dist = tmp_path / "site" / "asyncflow_echo_engine-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: asyncflow-echo-engine\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{_entry_point_line()}")
    return [str(tmp_path / "site"), str(EXAMPLE)]


@pytest.fixture
def plugin(plugin_path, monkeypatch):
    for p in reversed(plugin_path):
        monkeypatch.syspath_prepend(p)
    yield
    sys.modules.pop(MODULE, None)


def test_without_the_plugin_echo_is_unknown():
    """Nothing in asyncflow names ``echo``: the entry point is what makes it known."""
    from importlib.metadata import entry_points

    if any(ep.name == "echo" for ep in entry_points(group=ENTRY_POINT_GROUP)):
        pytest.skip("an engine named 'echo' is installed in this environment")
    assert "echo" not in engine_names()
    with pytest.raises(UserError) as err:
        check_file(str(PIPELINE))
    assert {d.code for d in err.value.diagnostics} == {"AF323"}


def test_engine_names_lists_echo(plugin):
    names = engine_names()
    assert names["echo"] == f"{MODULE}:EchoEngine"
    assert list(names)[:4] == ["hf", "vllm", "deepspeed", "sim"]  # built-ins first


def test_pipeline_checks_without_importing_the_engine(plugin):
    sys.modules.pop(MODULE, None)
    pipeline, graph = check_file(str(PIPELINE))
    assert {t.engine for t in pipeline.tasks.values() if t.engine} == {"echo"}
    assert MODULE not in sys.modules  # names come from metadata, the module is never imported


def test_cli_check_in_a_fresh_process(plugin_path):
    """The real discovery path: a new interpreter, the plug-in found on PYTHONPATH, and neither
    torch nor the engine imported by ``check``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(plugin_path + [str(ROOT)]))
    code = ("import sys; from asyncflow.check import check_file; "
            f"check_file({str(PIPELINE)!r}); "
            f"assert 'torch' not in sys.modules and {MODULE!r} not in sys.modules, 'imported'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_load_engine_class_and_generate(plugin):
    cls = load_engine_class("echo")
    assert cls.__name__ == "EchoEngine" and cls.__module__ == MODULE
    spec = EngineSpec(task="generate", kind="rollout", model={"name": "policy"},
                      args={"max_new_tokens": 16}, inputs=("prompt",),
                      outputs=("response", "logprobs"))
    e = cls(spec)
    assert isinstance(e, Rollout) and isinstance(e, Scorer) and isinstance(e, Trainer)
    batch = {"prompt": ["12+7=", "abc"], "_row": [0, 1], "_group": [0, 1]}
    out = e.generate(batch)
    assert set(out) == {"response", "logprobs"}
    assert [str(r) for r in out["response"]] == ["=7+21", "cba"]
    for prompt, r, lp in zip(batch["prompt"], out["response"], out["logprobs"]):
        assert isinstance(r, Text)
        assert r.ids[-1] == e.tokenizer.eos_id and e.tokenizer.decode(r.ids) == str(r)
        assert e.tokenizer.decode(r.prompt_ids) == prompt
        assert len(lp) == len(r.ids) and all(isinstance(x, float) and x < 0 for x in lp)

    # the scorer gives the same log-probs for those responses; a weight update shows
    scorer = cls(EngineSpec(task="ref", kind="logprob", model={}, outputs=("ref_logprobs",)))
    assert scorer.logprobs({"response": out["response"]}) == {"ref_logprobs": out["logprobs"]}
    e.update_weights(e.export_weights(), 3)
    assert e.generate(batch)["logprobs"][0][0] < out["logprobs"][0][0]


def test_trainer_save_load(plugin, tmp_path):
    cls = load_engine_class("echo")
    t = cls(EngineSpec(task="update", kind="train", model={}, loss="grpo"))
    assert t.train_step({"response": ["x", "y"]})["version"] == 1.0
    t.save(str(tmp_path / "ckpt"))
    u = cls(EngineSpec(task="update", kind="train", model={}, loss="grpo"))
    u.load(str(tmp_path / "ckpt"))
    assert u.export_weights() == t.export_weights() == {"version": 1}


def test_unknown_engine_is_af323_with_did_you_mean(plugin, tmp_path):
    text = PIPELINE.read_text().replace("engine: echo    ", "engine: ecko    ", 1)
    assert "engine: ecko" in text
    bad = tmp_path / "pipeline.yaml"
    bad.write_text(text)
    with pytest.raises(UserError) as err:
        check_file(str(bad))
    (d,) = err.value.diagnostics
    assert d.code == "AF323" and "'ecko'" in d.message and "echo" in d.message  # known list
    assert d.hint == "did you mean 'echo'?"
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "engine: ecko" in s)
    assert (d.loc.line, d.loc.col) == (line, text.splitlines()[line - 1].index("ecko") + 1)
