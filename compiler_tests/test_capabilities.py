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
    with pytest.warns(RuntimeWarning, match="broken.dist-info.*bad METADATA"):
        names = engine_names()
    assert list(names)[:4] == list(BUILTIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_names()  # once per distribution
