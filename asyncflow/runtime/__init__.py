"""The runtime: executes an ExecutionPlan (DESIGN.md, "The runtime").

==============  ==============================================================
module          what it owns
==============  ==============================================================
``driver``      feeds prompts, starts workers, writes metrics/trace: ``run_plan``
``loops``       a task replica's loops and op handlers, written once for the runtime and the
                simulator (``serve``: continuous batching; ``step_reads``: a train step's reads)
``worker``      their real-time host: a thread or Ray actor's thread (``signals``: Crash, Stop)
``gate``        the staleness gate (who may start / consume what)
``weights``     weight publication and adoption (deferred sync), exposed time
``tasks``       reward / advantage / filter / custom functions over column batches
``trace``       spans -> Chrome trace; metrics.jsonl
``backends``    local threads vs Ray actors, one per process of the plan (+ the control plane)
``store``       the streaming sample store (``ray_store``: sharded on Ray; ``store_api``: the
                ``Store`` protocol; ``codec``: column types)
==============  ==============================================================

Nothing is imported eagerly: ``import asyncflow.runtime`` never imports Ray.
"""


def run_plan(plan, backend: str = "local", **kw):
    """Execute ``plan``; see :class:`asyncflow.runtime.driver.Driver`."""
    from asyncflow.runtime.driver import run_plan as _run

    return _run(plan, backend, **kw)
