"""Every task kind of the kinds table has its rules module, and every rules module names a kind
of the table (asyncflow.compiler.kinds); the passes ask the rules, never a kind's name."""
import pkgutil
import re
from pathlib import Path

import asyncflow.compiler.kinds as kinds_pkg
from asyncflow.compiler.kinds import RULES, KindRules, kinds_that, rules_of
from asyncflow.kinds import KINDS

ROOT = Path(__file__).resolve().parents[1] / "asyncflow"


def test_every_kind_has_rules_and_every_rules_module_names_a_kind():
    assert set(RULES) == set(KINDS)
    for name, rules in RULES.items():
        assert rules.name == name and isinstance(rules, KindRules)
        assert rules.kind is KINDS[name]
    modules = {m.name for m in pkgutil.iter_modules(kinds_pkg.__path__)} - {"base"}
    assert modules == set(KINDS)


def test_unknown_kind_gets_no_op_rules():
    r = rules_of("no-such-kind")
    assert not r.trains and r.replaces({"refill": True, "consume": "first_ready"}) is None


def test_traits():
    assert kinds_that("trains") == ("train",)
    assert kinds_that("samples") == ("rollout",)
    assert kinds_that("rewards") == ("reward",)
    assert kinds_that("critic") == ("value",)


def test_no_kind_name_comparisons_in_the_compiler():
    """Task-kind comparisons (``t.kind == "train"``) live in the rules modules only."""
    pat = re.compile(r'\.kind\s*(==|!=)\s*"(%s)"|\.kind\s+(not\s+)?in\s*[({]\s*"(%s)"'
                     % ("|".join(KINDS), "|".join(KINDS)))
    files = [p for p in (ROOT / "compiler").rglob("*.py") if "kinds" not in p.parts]
    files += [ROOT / "check.py", ROOT / "commands" / "compile.py", *(ROOT / "viz").glob("*.py")]
    hits = [f"{p}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pat.search(line)]
    assert hits == []
