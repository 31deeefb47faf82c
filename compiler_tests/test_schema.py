"""The JSON Schema and the language reference: generated from the tables, valid for every shipped
pipeline, strict where the checker is, and equal to the copies in docs/."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from asyncflow import kinds
from asyncflow.check import check_file
from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl import build
from asyncflow.langdoc import language_markdown
from asyncflow.schema import KEY_DOCS, json_schema
from compiler_tests.conftest import PIPELINES, ROOT, pipeline_files

SCHEMA_FILE = ROOT / "docs" / "asyncflow.schema.json"
LANGUAGE_FILE = ROOT / "docs" / "language.md"
REGENERATE = ("regenerate with: asyncflow schema -o docs/asyncflow.schema.json && "
              "asyncflow schema --markdown -o docs/language.md")
MODELINE = "# yaml-language-server: $schema=../docs/asyncflow.schema.json\n"


@pytest.fixture(scope="module")
def validator():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], cwd=cwd,
                          capture_output=True, encoding="utf-8", timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def _errors(validator, doc) -> list[str]:
    return [e.message for e in validator.iter_errors(doc)]


# -- generated from the tables -------------------------------------------------------------------
def test_every_key_of_every_section_has_a_description():
    assert set(KEY_DOCS) == set(build.SECTIONS)
    for what, table in build.SECTIONS.items():
        assert set(KEY_DOCS[what]) == set(table), what
        assert all(KEY_DOCS[what].values()), what


def test_enums_are_the_tables():
    task = json_schema()["$defs"]["task"]["properties"]
    assert tuple(task["kind"]["enum"]) == kinds.TASK_KINDS == build.TASK["kind"].choices
    assert task["estimator"]["enum"] == list(kinds.ESTIMATORS)
    assert task["loss"]["enum"] == list(kinds.LOSSES)
    for name in kinds.TASK_KINDS:
        assert f"{name}: {kinds.KINDS[name].doc}" in task["kind"]["description"]


def test_every_key_and_definition_has_a_description():
    schema = json_schema()
    sections = [("#", schema)] + [(f"$defs.{k}", d) for k, d in schema["$defs"].items()]
    for where, node in sections:
        assert node.get("description") or "properties" in node, where
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{where}.{key}"


# -- the shipped pipelines ------------------------------------------------------------------------
@pytest.mark.parametrize("path", pipeline_files(".yaml"), ids=lambda p: p.name)
def test_shipped_yaml_pipeline_is_valid(validator, path):
    assert _errors(validator, yaml.safe_load(path.read_text(encoding="utf-8"))) == []


@pytest.mark.parametrize("path", pipeline_files(".af"), ids=lambda p: p.name)
def test_shipped_af_pipeline_is_valid_as_yaml(validator, path):
    from asyncflow.dsl.emit import emit_yaml
    from asyncflow.dsl.load import load_file

    assert _errors(validator, yaml.safe_load(emit_yaml(load_file(str(path))))) == []


# -- invalid pipelines: the schema and the checker both reject them ------------------------------
def _set(doc, path, value):
    *parents, last = path
    for p in parents:
        doc = doc[p]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()
INVALID = {
    "unknown top-level key": (("learning_rate",), 0.1),
    "unknown task key": (("tasks", "score", "fnn"), "asyncflow.rewards:digits_match"),
    "wrong kind": (("tasks", "score", "kind"), "rewards"),
    "reward without fn": (("tasks", "score", "fn"), _DELETE),
    "rollout without engine": (("tasks", "generate", "engine"), _DELETE),
    "engine on a reward": (("tasks", "score", "engine"), "hf"),
    "negative devices": (("pools", "rollout", "devices"), -1),
    "zero replicas": (("tasks", "generate", "replicas"), 0),
    "max_staleness -1": (("sync", 0, "max_staleness"), -1),
    "string for an int": (("step", "steps"), "200"),
    "bool for an int": (("seed",), True),
    "string for a list of names": (("tasks", "score", "inputs"), "prompt"),
    "bad field name": (("tasks", "score", "inputs"), ["prompt", "the-answer"]),
    "repeated field": (("tasks", "score", "inputs"), ["prompt", "prompt"]),
    "unknown estimator": (("tasks", "advantage", "estimator"), "ppo"),
    "unknown loss": (("tasks", "update", "loss"), "grpo2"),
    "fn not a reference": (("tasks", "score", "fn"), "digits_match"),
    "unknown sync key": (("sync", 0, "staleness"), 1),
    "sync without max_staleness": (("sync", 0, "max_staleness"), _DELETE),
    "step without steps": (("step", "steps"), _DELETE),
    "pool without devices": (("pools", "train"), {}),
    "reward with no outputs": (("tasks", "score", "outputs"), []),
    "schedule on a train task": (("tasks", "update", "schedule"), "queue"),
    "refill on a reward": (("tasks", "score", "refill"), True),
    "unknown schedule": (("tasks", "generate", "schedule"), "fifo"),
    "unknown on_update": (("tasks", "generate", "on_update"), "restart"),
    "unknown consume": (("tasks", "update", "consume"), "newest"),
    "redundancy below 1": (("tasks", "generate", "redundancy"), 0.5),
    "string for redundancy": (("tasks", "generate", "redundancy"), "1.25"),
    "string for stream": (("tasks", "update", "stream"), "yes"),
}


def test_the_unmutated_base_passes_both(validator, tmp_path):
    doc = yaml.safe_load((PIPELINES / "grpo_digits.yaml").read_text(encoding="utf-8"))
    assert _errors(validator, doc) == []
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(doc, sort_keys=False))
    diags = Diagnostics()
    check_file(str(good), (), diags)
    assert not diags.errors


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_pipeline_fails(validator, case, tmp_path):
    doc = yaml.safe_load((PIPELINES / "grpo_digits.yaml").read_text(encoding="utf-8"))
    _set(doc, *INVALID[case])
    assert _errors(validator, doc), f"the schema accepts: {case}"
    # the checker agrees: what the schema rejects, `asyncflow check` rejects too
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    diags = Diagnostics()
    check_file(str(bad), (), diags)
    assert diags.errors, f"asyncflow check accepts: {case}"


# -- the copies in docs/ and the command ------------------------------------------------------
def test_docs_schema_is_current():
    assert json.loads(SCHEMA_FILE.read_text(encoding="utf-8")) == json_schema(), REGENERATE


def test_docs_language_is_current():
    assert LANGUAGE_FILE.read_text(encoding="utf-8") == language_markdown(), REGENERATE


def test_schema_command(tmp_path):
    r = _cli("schema")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json_schema()
    assert r.stdout == SCHEMA_FILE.read_text(encoding="utf-8")
    r = _cli("schema", "--markdown")
    assert r.returncode == 0, r.stderr
    assert r.stdout == language_markdown()
    out = tmp_path / "s.json"
    assert _cli("schema", "-o", str(out)).returncode == 0
    assert json.loads(out.read_text(encoding="utf-8")) == json_schema()


def test_readme_links_the_reference_and_shows_the_modeline():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/language.md)" in readme
    assert MODELINE.strip() in readme
    assert "LANGUAGE.md" not in readme and "../shared" not in readme


# -- an editor's view: the schema named in the file's first line -----------------------------------
def test_modeline_resolves_and_the_file_still_checks(tmp_path, validator):
    (tmp_path / "docs").symlink_to(ROOT / "docs", target_is_directory=True)
    (tmp_path / "pipelines").mkdir()
    pipeline = tmp_path / "pipelines" / "grpo_digits.yaml"
    pipeline.write_text(MODELINE + (PIPELINES / "grpo_digits.yaml").read_text(encoding="utf-8"))

    r = _cli("check", str(pipeline))
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout

    first = pipeline.read_text(encoding="utf-8").splitlines()[0]
    rel = re.fullmatch(r"# yaml-language-server: \$schema=(\S+)", first).group(1)
    resolved = (pipeline.parent / rel).resolve()
    assert resolved == SCHEMA_FILE.resolve()
    assert (PIPELINES / rel).resolve() == SCHEMA_FILE.resolve()  # the same line works in pipelines/
    editor = jsonschema.Draft202012Validator(json.loads(resolved.read_text(encoding="utf-8")))
    doc = yaml.safe_load(pipeline.read_text(encoding="utf-8"))
    assert editor.is_valid(doc)
    broken = copy.deepcopy(doc)
    broken["tasks"]["score"]["kind"] = "rewards"
    assert not editor.is_valid(broken)
