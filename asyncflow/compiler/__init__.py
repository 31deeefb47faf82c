"""The compiler: ordered, named, pure passes from pipeline source to ExecutionPlan.

``compile_file(path, sets=())`` / ``compile_text`` / ``compile_pipeline(ast)`` -> :class:`Plan`.
The pass list is :mod:`asyncflow.compiler.pipeline`; the runner, ``verify`` and the pass context
are in :mod:`asyncflow.compiler.runner`. Importing this package imports no ray, torch,
transformers, vllm or deepspeed (``compiler_tests/test_no_heavy_imports.py``).
"""
from asyncflow.compiler.pipeline import (ALL, PASS_NAMES, PASSES, compile_file, compile_pipeline,
                                         compile_text)
from asyncflow.compiler.runner import Context, Pass, PassFailed, run_passes, verify

__all__ = ["compile_file", "compile_text", "compile_pipeline", "verify", "run_passes", "Context",
           "Pass", "PassFailed", "PASSES", "ALL", "PASS_NAMES"]
