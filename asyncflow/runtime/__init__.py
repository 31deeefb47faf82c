"""The runtime: executes an ExecutionPlan (DESIGN.md, "The runtime").

==============  ==============================================================
module          what it owns
==============  ==============================================================
``driver``      a package: feeds prompts, starts workers, writes metrics/trace: ``run_plan``
                (``core``: the Driver; ``feeding``; ``metrics``; ``records``: run files
                and checkpoint closing; ``supervise``: deaths, restarts, the watchdog)
``faults``      RunError, the AF63x faults, ``--inject`` parsing
``options``     RunOptions: one run's knobs, handed down from the CLI
``loops``       a task replica's loops and op handlers, written once for the runtime and the
                simulator (``serve``: continuous batching; ``step_reads``: a train step's reads)
``worker``      their real-time host: a thread or Ray actor's thread (``signals``: Crash, Stop)
``gate``        the staleness gate (who may start / consume what)
``weights``     weight publication and adoption (deferred sync), exposed time
``tasks``       reward / advantage / filter / custom functions over column batches
``trace``       spans -> Chrome trace; metrics.jsonl
``backends``    the backends by name: ``local_backend`` (threads), ``ray_backend`` (one actor
                per process of the plan); ``control``: the control plane; ``placement``:
                bundles, feasibility, CPU pinning; ``ray_connect``/``ray_patch``: starting Ray
``store``       the streaming sample store, a package (``local``: in process; ``ray``: sharded
                on Ray; ``protocol``: the ``Store`` seam; ``codec``: column types)
``rundir``      the run directory's rules (lock, manifest, ``--force``, ``--resume``)
==============  ==============================================================

Nothing is imported eagerly: ``import asyncflow.runtime`` never imports Ray.
"""


def run_plan(plan, backend: str = "local", **kw):
    """Execute ``plan``; see :class:`asyncflow.runtime.driver.Driver`."""
    from asyncflow.runtime.driver import run_plan as _run

    return _run(plan, backend, **kw)
