"""Compiling imports no ray, torch, transformers, vllm or deepspeed (DESIGN.md, Layers)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("ray", "torch", "transformers", "vllm", "deepspeed")


def test_compiler_imports_nothing_heavy():
    code = (
        "import sys\n"
        "import asyncflow.compiler\n"
        "from asyncflow.compiler import compile_file\n"
        "import asyncflow.viz.graph, asyncflow.viz.html, asyncflow.commands.compile\n"
        "plan = compile_file('pipelines/grpo_digits.yaml')\n"
        "plan = compile_file('pipelines/sim_longtail.yaml')\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules or any(k.startswith(m + '.') for k in sys.modules)]\n"
        "print(','.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"heavy modules imported: {r.stdout.strip()}"
