"""Packaging that cannot miss a module (issue 21, deliverable 9; failure 7: a `pip install .`
without `asyncflow.simulate` crashed `compile` and `simulate`).

The wheel is built from a copy of this checkout (no build isolation, nothing downloaded) and
installed with `--no-deps` into a fresh venv. That venv gets its dependencies (lark, networkx,
yaml, ...) from the test venv through a `.pth` line naming the test venv's site-packages, which is
appended *after* the fresh venv's own site-packages -- and a `.pth` line only adds a directory, so
the test venv's editable-install hook (a `.pth` inside that directory) is never run: `asyncflow`
is imported from the installed wheel, which the test asserts. Then the installed console script
runs `check`, `compile`, `simulate` and `schema` on pipelines/ from another working directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a wheel does not need: bulky or irrelevant to the build (and the build outputs themselves);
# ".*": every hidden folder (.git, .venv, .venv-vllm: copying a venv of vLLM took two minutes)
_SKIP = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__",
                               "tests", "compiler_tests", "examples", "benchmarks", "docs", ".ci")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel built from this checkout; returns its directory."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)  # a clean tree: no stale build/lib from a past build
    out = tmp / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("asyncflow-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_asyncflow_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run([*args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_the_wheel_holds_every_module_and_the_grammar(installed):
    """Every .py file of asyncflow/ and dsl/ is installed (dsl/ as asyncflow.dsl), and the data
    files the CLI reads from the package: the grammar and the DSL reference."""
    site = next((installed / "lib").glob("python*/site-packages"))
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "asyncflow").rglob("*.py")
            if "__pycache__" not in p.parts}
    want |= {"asyncflow/dsl/" + p.name for p in (ROOT / "dsl").glob("*.py")}
    want |= {"asyncflow/dsl/asyncflow.lark", "asyncflow/dsl/README.md"}
    have = {str(p.relative_to(site)) for p in (site / "asyncflow").rglob("*") if p.is_file()}
    assert not want - have, f"missing from the installed package: {sorted(want - have)}"


def test_the_installed_cli_checks_compiles_simulates(installed, tmp_path):
    cwd = tmp_path / "elsewhere"  # not the checkout: nothing can be imported from the source tree
    cwd.mkdir()
    r = _run(installed, "python", "-c", "import asyncflow, asyncflow.dsl, asyncflow.simulate; "
             "print(asyncflow.__file__); print(asyncflow.dsl.__file__)", cwd=cwd)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert Path(line).resolve().is_relative_to(installed.resolve()), r.stdout
    cli = str(installed / "bin" / "asyncflow")
    pipelines = ROOT / "pipelines"

    for f in ("grpo_digits.yaml", "grpo_digits.af", "sim_longtail.yaml"):
        r = _run(installed, cli, "check", str(pipelines / f), cwd=cwd)
        assert r.returncode == 0 and "ok" in r.stdout, (f, r.stdout + r.stderr)

    r = _run(installed, cli, "compile", str(pipelines / "grpo_digits.yaml"), cwd=cwd)
    assert r.returncode == 0 and "generate" in r.stdout, r.stdout + r.stderr
    r = _run(installed, cli, "compile", str(pipelines / "sim_longtail.yaml"), "--json", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert [t["name"] for t in json.loads(r.stdout)["tasks"]][:1] == ["generate"]

    r = _run(installed, cli, "simulate", str(pipelines / "sim_longtail.yaml"), "--steps", "3", "--json",
             cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "internal error" not in r.stderr

    r = _run(installed, cli, "schema", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "data" in json.loads(r.stdout)["properties"]
    r = _run(installed, cli, "schema", "--markdown", cwd=cwd)
    assert r.returncode == 0 and r.stdout.startswith("#"), r.stderr


def test_the_wheel_ships_the_console_script(installed):
    site = next((installed / "lib").glob("python*/site-packages"))
    (ep,) = site.glob("asyncflow-*.dist-info/entry_points.txt")
    assert "asyncflow = asyncflow.cli:main" in ep.read_text()
