"""Engines declare their capabilities on the class (asyncflow.engines.base.Capabilities); the
built-ins' are known without importing them, and a broken plug-in distribution is reported."""
import sys
import warnings

import pytest

from asyncflow.engines import base
from asyncflow.engines.base import (BUILTIN, BUILTIN_CAPABILITIES, Capabilities, capabilities,
                                    class_capabilities, engine_names)


def test_every_builtin_has_capabilities_and_reading_them_imports_nothing():
    assert set(BUILTIN_CAPABILITIES) == set(BUILTIN)
    for name in BUILTIN:
        assert capabilities(name) is BUILTIN_CAPABILITIES[name]
    mods = {m for m in sys.modules if m.startswith("asyncflow.engines.") and m != "asyncflow.engines.base"}
    for name in BUILTIN:
        capabilities(name)
    assert {m for m in sys.modules if m.startswith("asyncflow.engines.")
            and m != "asyncflow.engines.base"} == mods


def test_sim_class_points_at_its_table_entry():
    from asyncflow.engines.sim import SimEngine

    assert SimEngine.capabilities is BUILTIN_CAPABILITIES["sim"]
    assert class_capabilities(SimEngine).serves and not SimEngine.capabilities.uses_device


def test_a_class_without_capabilities_gets_the_defaults():
    class Plain:
        def serve(self, pull, emit): ...

    class Old:
        uses_device = False
        distributed = True

    assert class_capabilities(Plain) == Capabilities(serves=True)
    assert class_capabilities(Old) == Capabilities(uses_device=False, distributed=True)
    assert capabilities(None) == Capabilities() == capabilities("no-such-engine")


def test_runs_kind():
    assert BUILTIN_CAPABILITIES["vllm"].runs_kind("rollout")
    assert not BUILTIN_CAPABILITIES["vllm"].runs_kind("train")
    assert BUILTIN_CAPABILITIES["hf"].runs_kind("train")


def test_a_broken_distribution_is_reported_not_silently_dropped(tmp_path, monkeypatch):
    class Broken:
        @property
        def metadata(self):
            raise ValueError("bad METADATA")

        def locate_file(self, path):
            return tmp_path / "broken.dist-info"

    from importlib import metadata

    real = metadata.distributions
    monkeypatch.setattr(metadata, "distributions", lambda: [Broken(), *real()])
    monkeypatch.setattr(base, "_REPORTED", set())
    monkeypatch.setattr(base, "_NAMES", {})  # the fake changes no directory: read again
    with pytest.warns(RuntimeWarning, match="broken.dist-info.*bad METADATA"):
        names = engine_names()
    assert list(names)[:4] == list(BUILTIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_names()  # once per distribution


def test_engine_names_are_read_again_when_a_distribution_is_installed(tmp_path, monkeypatch):
    """The scan of the installed distributions is kept until the path or a directory on it
    changes: a plug-in installed later (a new dist-info) is found at the next call."""
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late_engine" not in engine_names()
    info = tmp_path / "late_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[asyncflow.engines]\nlate_engine = late_mod:Engine\n")
    assert engine_names()["late_engine"] == "late_mod:Engine"
