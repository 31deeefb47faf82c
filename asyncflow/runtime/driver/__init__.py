"""The driver: executes an :class:`~asyncflow.plan.Plan` on a backend and records the run.

What it does, top to bottom (:meth:`Driver.run <asyncflow.runtime.driver.core.Driver.run>`):

1. load the prompts of the plan's data source;
2. make the store (one row per sample) and the control plane, register every task's inputs;
3. start one worker per :class:`~asyncflow.plan.WorkerPlan` (threads or Ray actors), a pool's
   colocated workers in its time-sharing order (``TaskPlan.time_share``: the first builds its
   engine on the shared devices first);
4. feed prompts (:mod:`.feeding`): prompt ``k`` is replicated ``samples_per_prompt`` times (one
   ``_group``) and belongs to step ``k // prompts_per_step``, so step ``s`` owns rows
   ``[s * samples_per_step, (s + 1) * samples_per_step)``. The driver is the data sources'
   producer: it keeps each source channel as full as the plan's ``capacity`` says (rows of steps
   below ``trained + capacity / samples_per_step``; staleness rule 5: the step being trained,
   the steps the gate lets producers run ahead -- the plan's ``run_ahead`` -- and one in flight);
5. every few milliseconds collect the workers' reports; per finished train step write one line
   of ``metrics.jsonl`` (:mod:`.metrics`, :mod:`.records`) and call ``on_step``;
6. when every train task has done its last step (or, without one, every row is consumed), stop
   the workers, write ``trace.json`` and return a :class:`RunResult`.

With ``checkpoint_every`` K, every K train steps go to ``RUN_DIR/checkpoints/step_N``;
``resume=True`` continues ``RUN_DIR`` from its newest complete one
(:mod:`asyncflow.runtime.checkpoint`; rows of later steps are regenerated); with
``keep_checkpoints`` K only the newest K complete ones stay. Every train step's rows go to
``RUN_DIR/train_rows.jsonl``. After its last step, and at each checkpoint, each trainer writes
its model to ``RUN_DIR/final/<model>`` (:mod:`asyncflow.runtime.export`) and reports it
(:attr:`RunResult.exports`). Deaths, restarts and the watchdog: :mod:`.supervise`; faults and
``--inject``: :mod:`asyncflow.runtime.faults`.

A KeyboardInterrupt stops the workers the same way, writes the partial trace and metrics, and
propagates. ``RUN_DIR`` (``out_dir``) receives ``plan.json``, ``metrics.jsonl``, ``trace.json`` and
``workers.json`` (where each worker ran: task, pool, host, pid, Ray node, pinned cores; its end).
"""
from asyncflow.runtime.data import load_prompts
from asyncflow.runtime.driver.core import (DRIVER_POLL_S, LOCAL_DEFAULTS, RAY_DEFAULTS, Driver,
                                           RunResult, run_plan)
from asyncflow.runtime.driver.feeding import (REFILL_ROUNDS, feed_ahead, feed_target,
                                              replaced_groups)
from asyncflow.runtime.driver.metrics import merged_shares
from asyncflow.runtime.faults import (INJECT_KINDS, RunError, fault, parse_inject,
                                      worker_error)

__all__ = ["DRIVER_POLL_S", "INJECT_KINDS", "LOCAL_DEFAULTS", "RAY_DEFAULTS", "REFILL_ROUNDS",
           "Driver", "RunError", "RunResult", "fault", "feed_ahead", "feed_target",
           "load_prompts", "merged_shares", "parse_inject", "replaced_groups", "run_plan",
           "worker_error"]
