"""Input limits: hostile YAML (alias bombs, recursive aliases, deep nesting, huge files) and
hostile ``--set`` values are located AF1xx errors, never a hang or an internal error.

The limits: nesting 64 (AF107), 100,000 values after expanding aliases in a file and 10,000 in
an override (AF108), 1 MiB per file and 100,000 characters per override value (AF109). The
subprocess timeout is a hang guard, not a timing assertion."""
from __future__ import annotations

import subprocess
import sys

import pytest

from asyncflow.check import check_file
from asyncflow.diagnostics import Diagnostics

LOL = ", ".join(['"lol"'] * 9)
BILLION = "a: &a [" + LOL + "]\n" + "".join(
    f"{b}: &{b} [" + ", ".join([f"*{a}"] * 9) + "]\n" for a, b in zip("abcdefgh", "bcdefghi")
) + "pipeline: x\n"  # 9^9 = 387 million values when expanded


def codes(path, sets=()):
    d = Diagnostics()
    check_file(str(path), sets=sets, diags=d)
    return [(x.code, x.loc.line if x.loc else None) for x in d.errors]


@pytest.mark.parametrize("text,code,line", [
    (BILLION, "AF108", 5),  # the anchor whose expansion passes the limit
    ("pipeline: x\nx: &a [1, *a]\n", "AF108", 2),
    ("pipeline: x\nx: &a {k: *a}\n", "AF108", 2),
    ("pipeline: x\nx: " + "[" * 1000 + "]" * 1000 + "\n", "AF107", 2),
    ("pipeline: x\nx: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n", "AF107", 2),
    ("pipeline: x\n" + "".join("  " * i + f"k{i}:\n" for i in range(1000)), "AF107", 66),
    ("pipeline: x\nx:\n" + "".join("  " * i + "-\n" for i in range(1, 1000)), "AF107", 66),
])
def test_hostile_yaml_is_a_located_error(tmp_path, text, code, line):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    assert codes(p) == [(code, line)]


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("pipeline: x\n#" + "x" * (1 << 20) + "\n")
    assert codes(p) == [("AF109", 1)]


@pytest.mark.parametrize("value,code", [
    ("[" * 200 + "]" * 200, "AF107"),
    ("[&a [1,1,1,1,1,1,1,1,1,1], &b [" + ",".join(["*a"] * 10) + "], &c ["
     + ",".join(["*b"] * 10) + "], &d [" + ",".join(["*c"] * 10) + "]]", "AF108"),
    ("[&a [*a]]", "AF108"),
    ("[" + "1," * 60_000 + "1]", "AF109"),
])
def test_hostile_set_values_are_located_in_the_override(value, code):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    d = Diagnostics()
    check_file(str(root / "pipelines/grpo_digits.yaml"), sets=[f"tasks.update.args.x={value}"],
               diags=d)
    assert [(x.code, x.loc.file) for x in d.errors] == [(code, "--set[1]")]


def test_the_cli_answers_a_bomb_with_exit_2_and_no_traceback(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(BILLION)
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "AF108" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
