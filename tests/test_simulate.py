"""``asyncflow simulate`` (asyncflow/simulate/core.py): fidelity against real runs, the targeted
wake-ups against an exhaustive simulation, the scheduling semantics, and determinism."""
from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.compiler.pipeline import compile_file
from asyncflow.runtime.store import SampleStore
from asyncflow.simulate import simulate
from asyncflow.simulate.core import Simulation
from asyncflow.simulate.vstore import VStore

LONGTAIL = "pipelines/sim_longtail.yaml"
AGENTIC = "pipelines/agentic_sim.yaml"
PPO = "pipelines/ppo_gae.yaml"
# ppo_gae on the sim engine: two trainers (policy and critic), a ref scorer and a value scorer
PPO_SIM = [f"tasks.{t}.engine=sim" for t in ("generate", "ref", "value", "update", "critic_update")]


def latency(seed: int, sigma: float = 1.5) -> str:
    return ("tasks.generate.args.latency="
            f"{{dist: lognormal, median: 0.05, sigma: {sigma}, max: 2.0, seed: {seed}}}")


# benchmarks/scheduling.py's workload: one rollout replica of 64 slots and a long tail, a 2 ms
# trainer: rollout-bound, so scheduling keys and staleness change the timeline
W = ["tasks.generate.replicas=1", "pools.rollout.devices=1", "tasks.generate.args.slots=64",
     latency(5), "step.prompts_per_step=16", "step.samples_per_prompt=4",
     "tasks.update.args.seconds_per_sample=0.002", "tasks.update.args.micro_batch=16"]
PARETO = "tasks.generate.args.latency={dist: pareto, scale: 0.03, alpha: 1.2, max: 2.0, seed: 5}"

CONFIGS = {
    "longtail a=0": (LONGTAIL, ["sync.0.max_staleness=0"]),
    "longtail a=1": (LONGTAIL, ["sync.0.max_staleness=1"]),
    "longtail a=2": (LONGTAIL, ["sync.0.max_staleness=2"]),
    "first_ready+continue": (LONGTAIL, ["sync.0.max_staleness=1",
                                        "tasks.update.consume=first_ready",
                                        "tasks.generate.on_update=continue"]),
    "redundancy 1.5": (LONGTAIL, ["sync.0.max_staleness=1", "tasks.generate.redundancy=1.5"]),
    "schedule batch": (LONGTAIL, ["sync.0.max_staleness=1", "tasks.generate.schedule=batch"]),
    "stream false": (LONGTAIL, ["sync.0.max_staleness=0", "tasks.update.stream=false"]),
    "agentic_sim": (AGENTIC, []),
    "ppo_gae on sim": (PPO, PPO_SIM),
    "W a=0": (LONGTAIL, W + ["sync.0.max_staleness=0"]),
    "W a=1 continue": (LONGTAIL, W + ["sync.0.max_staleness=1",
                                      "tasks.generate.on_update=continue"]),
    "W a=2 abort": (LONGTAIL, W + ["sync.0.max_staleness=2", "tasks.generate.on_update=abort"]),
    "W first_ready+continue": (LONGTAIL, W + ["sync.0.max_staleness=1",
                                              "tasks.update.consume=first_ready",
                                              "tasks.generate.on_update=continue"]),
    "W pareto redundancy 1.5": (LONGTAIL, W + ["sync.0.max_staleness=1", PARETO,
                                               "tasks.generate.on_update=continue",
                                               "tasks.generate.redundancy=1.5"]),
    "W schedule batch": (LONGTAIL, W + ["sync.0.max_staleness=1", "tasks.generate.schedule=batch"]),
}


def plan_of(path: str, sets: list[str], steps: int):
    return compile_file(path, sets=list(sets) + [f"step.steps={steps}"])


def sim(path: str, sets: list[str], steps: int = 6, **kw):
    return simulate(plan_of(path, sets, steps), **kw)


# -- fidelity: the real run of the same plan -----------------------------------------------------

class RunQueueWait:
    """CPU-seconds the threads of this process were runnable but waited for a CPU (Linux
    ``/proc/self/task/*/schedstat``) while the ``with`` block ran: what the machine's load
    took from a real run (0.0 where the kernel does not say). Sampled every 20 ms, so a thread
    that ends loses at most its last 20 ms."""

    def __init__(self):
        self.seen: dict[str, float] = {}
        self.wait = 0.0
        self._stop = threading.Event()

    def _sample(self) -> None:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    wait = int(f.read().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                continue
            self.seen[tid] = max(self.seen.get(tid, 0.0), wait)

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __enter__(self) -> "RunQueueWait":
        self._sample()
        self._before = dict(self.seen)
        self._th = threading.Thread(target=self._loop, daemon=True)
        self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._th.join()
        self._sample()
        self.wait = sum(v - self._before.get(t, 0.0) for t, v in self.seen.items())


def _real_run(plan) -> tuple[float, float, float]:
    """(steady samples/s, steady seconds, CPU-seconds of run-queue wait in them) of a real
    local run; the run's wait is scaled to its steady part."""
    from asyncflow.runtime.driver import Driver

    t = time.time()
    with RunQueueWait() as q:
        ms = Driver(plan, "local").run().metrics
    wall = time.time() - t
    span = ms[-1]["time"] - ms[0]["time"]
    return sum(m["samples"] for m in ms[1:]) / span, span, q.wait * min(1.0, span / wall)


def test_fidelity_small_scale_against_real_local_runs():
    """sim_longtail at half speed (``time_scale`` 0.5 on the rollout and the trainer), alpha 0 and
    2, against the real local run of the same plan (measured: sim/real 1.01-1.05 here; at
    time_scale 0.1 the runtime's fixed per-step overheads alone reach ~20%):

    - the real run is never faster than the simulation by more than timer noise (what the
      simulator leaves out -- Python, flushes, control calls -- only slows a real run down, and
      so does a load on the machine): sim/real >= 0.9;
    - the real run is slower by at most the overheads the simulator leaves out (25% of the
      simulated steady time) plus the time the machine's load took from it: the CPU-seconds
      its threads were runnable but waited for a CPU (:class:`RunQueueWait`), over the 2 cores
      the run could use at once. On a quiet machine that is the plain 25% bound; a loaded one
      (real 297 vs simulated 400 samples/s once, when this was a bare ratio) widens it by what
      was measured, not by luck;
    - both agree that alpha 2 is faster than alpha 0."""
    import asyncflow.algos.advantages  # noqa: F401  (its torch import: start-up, not step 0)

    scale = ["tasks.generate.args.time_scale=0.5", "tasks.update.args.time_scale=0.5"]
    cores = max(1, min(2, os.cpu_count() or 1))
    real, simulated, load_free = {}, {}, {}
    for alpha in (0, 2):
        sets = scale + [f"sync.0.max_staleness={alpha}"]
        s = sim(LONGTAIL, sets, steps=8)
        simulated[alpha] = s.samples_per_s
        sim_span = s.step_ends[-1] - s.step_ends[0]
        for attempt in range(2):
            real[alpha], span, wait = _real_run(plan_of(LONGTAIL, sets, 8))
            what = (alpha, simulated[alpha], real[alpha], f"steady {span:.3f} s vs simulated "
                    f"{sim_span:.3f} s, run-queue wait {wait:.2f} CPU-s, attempt {attempt + 1}")
            assert simulated[alpha] / real[alpha] >= 0.9, what
            # noise only slows a real run (as test_fidelity_full_speed): a run slowed by what
            # the run-queue wait does not see (once in ~15 full suites here, 1.4 s at alpha 0
            # with a quiet run's wait) gets one more; a runtime overhead slows both
            if span <= 1.25 * sim_span + wait / cores:
                break
        assert span <= 1.25 * sim_span + wait / cores, what
        # the speed with the time the machine's load took from the run given back (a burst of
        # load in one of the two runs must not decide which alpha is faster)
        load_free[alpha] = real[alpha] * span / max(span - wait / cores, 0.5 * span)
    assert simulated[2] > 1.15 * simulated[0], simulated
    assert load_free[2] > 1.1 * real[0], (real, load_free)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["longtail a=0", "W a=1 continue", "W pareto redundancy 1.5"])
def test_fidelity_full_speed(name):
    """At full speed the runtime's overheads are 0.5-2.5% of a step on the local backend
    (benchmarks/simulate_fidelity.py): within 10% here, and the same redundant drops."""
    from asyncflow.runtime.driver import Driver

    import asyncflow.algos.advantages  # noqa: F401

    path, sets = CONFIGS[name]
    s = sim(path, sets, steps=12)
    real = 0.0
    for _ in range(2):  # the machine is shared: noise only slows a real run, keep the faster
        ms = Driver(plan_of(path, sets, 12), "local").run().metrics
        real = max(real, sum(m["samples"] for m in ms[1:]) / (ms[-1]["time"] - ms[0]["time"]))
        assert s.drops.get("redundant", 0) == int(ms[-1]["cancelled"] or 0)
        if s.samples_per_s / real <= 1.1:
            break
    assert 0.9 <= s.samples_per_s / real <= 1.1, (s.samples_per_s, real)


# -- the virtual-time store is the in-process store's rules ------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_virtual_time_store_runs_the_same_simulation_as_the_sample_store(name):
    """The simulator's event-indexed store (asyncflow/simulate/vstore.py) and the runtime's
    SampleStore give the very same simulated run: every step end, sample, drop and event."""
    path, sets = CONFIGS[name]
    runs = [sim(path, sets, steps=6, store=cls).to_dict() for cls in (VStore, SampleStore)]
    for d in runs:
        d.pop("wall_s"), d.pop("events_per_s")
    assert runs[0] == runs[1]
    assert runs[0]["steps"] == 6


# -- targeted wake-ups skip nothing ----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_targeted_wakeups_match_exhaustive(name):
    path, sets = CONFIGS[name]
    a = sim(path, sets, steps=6)
    b = sim(path, sets, steps=6, exhaustive=True)
    assert not a.stalled and not b.stalled
    assert len(a.step_ends) == 6
    assert a.step_ends == b.step_ends
    assert a.samples == b.samples and a.staleness_max == b.staleness_max
    assert a.drops == b.drops and a.cancelled == b.cancelled and a.aborted == b.aborted
    assert b.events > a.events  # the exhaustive run did poke more


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(alpha=st.integers(0, 3), seed=st.integers(0, 10_000),
       on_update=st.sampled_from(["finish", "continue", "abort"]),
       consume=st.sampled_from(["in_order", "first_ready"]))
def test_targeted_wakeups_match_exhaustive_property(alpha, seed, on_update, consume):
    sets = W[:3] + [latency(seed)] + W[4:] + [
        f"sync.0.max_staleness={alpha}", f"tasks.generate.on_update={on_update}",
        f"tasks.update.consume={consume}"]
    a = sim(LONGTAIL, sets, steps=5)
    b = sim(LONGTAIL, sets, steps=5, exhaustive=True)
    assert not a.stalled
    assert a.step_ends == b.step_ends and a.drops == b.drops


def test_exhaustive_comparison_catches_a_lost_wakeup(monkeypatch):
    """The comparison above can fail: lose every 7th write notification of the rollout and the
    targeted simulation stalls or diverges while the exhaustive one does not."""
    path, sets = CONFIGS["longtail a=0"]
    good = sim(path, sets, steps=6)
    wrote = Simulation.wrote
    calls = [0]

    def lossy(self, task, n):
        calls[0] += 1
        if task == "generate" and calls[0] % 7 == 0:
            return None
        return wrote(self, task, n)

    monkeypatch.setattr(Simulation, "wrote", lossy)
    a = sim(path, sets, steps=6)
    b = sim(path, sets, steps=6, exhaustive=True)
    assert b.step_ends == good.step_ends
    assert a.step_ends != b.step_ends or a.stalled


# -- semantics -------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0, 1, 2, 4])
@pytest.mark.parametrize("on_update", ["finish", "continue"])
def test_staleness_never_exceeds_alpha(alpha, on_update):
    r = sim(LONGTAIL, W + [f"sync.0.max_staleness={alpha}",
                           f"tasks.generate.on_update={on_update}"], steps=8)
    assert max(r.staleness_max) <= alpha
    assert max(r.staleness_max) == alpha  # this rollout-bound workload uses its whole bound
    assert all(0 <= m <= alpha for m in r.staleness_mean)


def test_first_ready_drops_what_staleness_forbids():
    path, sets = CONFIGS["W first_ready+continue"]
    r = sim(path, sets, steps=10)
    assert max(r.staleness_max) <= 1
    assert r.drops.get("staleness", 0) > 0  # too-old samples are dropped, never trained


@pytest.mark.parametrize("name", ["redundancy 1.5", "W pareto redundancy 1.5"])
def test_redundant_groups_dropped_and_cancelled(name):
    """redundancy 1.5 launches 1.5x the groups a step takes; the surplus of every step is
    dropped as 'redundant' (the real runs drop the same count: benchmarks/simulate_fidelity.py),
    the ones still generating are cancelled in flight."""
    path, sets = CONFIGS[name]
    steps = 8
    plan = plan_of(path, sets, steps)
    st_ = plan.step
    assert st_.launch_groups > st_.prompts_per_step
    r = simulate(plan)
    surplus = (st_.launch_groups - st_.prompts_per_step) * st_.samples_per_prompt
    assert r.drops.get("redundant") == steps * surplus
    assert 0 < r.cancelled <= r.drops["redundant"]
    assert set(r.drops) == {"redundant"}
    # without redundancy nothing is dropped or cancelled
    base = sim(path, [s for s in sets if "redundancy" not in s], steps=steps)
    assert base.drops == {} and base.cancelled == 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_step_trains_samples_per_step_rows(name):
    path, sets = CONFIGS[name]
    plan = plan_of(path, sets, 6)
    r = simulate(plan)
    assert r.samples == [plan.step.samples_per_step] * 6
    assert len(r.step_ends) == 6 and r.step_ends == sorted(r.step_ends) and r.step_ends[0] > 0


def test_long_tail_alpha0_slower_than_alpha2():
    r0 = sim(LONGTAIL, ["sync.0.max_staleness=0"], steps=10)
    r2 = sim(LONGTAIL, ["sync.0.max_staleness=2"], steps=10)
    assert r2.samples_per_s > 1.2 * r0.samples_per_s
    # the same on the rollout-bound workload, where alpha 2 (with continue) ~2.5x alpha 0
    w0 = sim(LONGTAIL, W + ["sync.0.max_staleness=0"], steps=10)
    w2 = sim(LONGTAIL, W + ["sync.0.max_staleness=2", "tasks.generate.on_update=continue"],
             steps=10)
    assert w2.samples_per_s > 2.0 * w0.samples_per_s


@pytest.mark.parametrize("d", [1, 4])
@pytest.mark.parametrize("stream", ["true", "false"])
def test_train_bound_step_time_is_n_s_over_d(d, stream):
    """A trainer at ``seconds_per_sample`` s on ``devices_per_replica`` d, rollouts nearly free
    and alpha 2: every steady step is exactly n * s / d."""
    s = 0.04
    r = sim(LONGTAIL, [f"pools.train.devices={d}", f"tasks.update.devices_per_replica={d}",
                       f"tasks.update.args.seconds_per_sample={s}", f"tasks.update.stream={stream}",
                       "tasks.generate.args.latency=0.001", "sync.0.max_staleness=2"], steps=5)
    n = r.samples_per_step
    assert r.step_time_s == pytest.approx(n * s / d, rel=1e-9)
    gaps = [b - a for a, b in zip(r.step_ends, r.step_ends[1:])]
    assert gaps == pytest.approx([n * s / d] * 4, rel=1e-9)
    assert r.samples_per_s == pytest.approx(d / s, rel=1e-9)


def test_time_scale_scales_the_timeline():
    base = sim(LONGTAIL, ["sync.0.max_staleness=1"], steps=5)
    half = sim(LONGTAIL, ["sync.0.max_staleness=1", "tasks.generate.args.time_scale=0.5",
                          "tasks.update.args.time_scale=0.5"], steps=5)
    assert half.step_ends == pytest.approx([t * 0.5 for t in base.step_ends], rel=1e-9)


# -- determinism -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["longtail a=2", "W first_ready+continue",
                                  "W pareto redundancy 1.5", "agentic_sim", "ppo_gae on sim"])
def test_deterministic(name):
    path, sets = CONFIGS[name]
    a = sim(path, sets, steps=6).to_dict()
    b = sim(path, sets, steps=6).to_dict()
    for k in ("wall_s", "events_per_s"):
        a.pop(k), b.pop(k)
    assert a == b
    # and a different latency seed gives a different run (the comparison can fail)
    if path == LONGTAIL and any("latency=" in s for s in sets):
        c = sim(path, [s.replace("seed: 5", "seed: 6") for s in sets], steps=6).to_dict()
        assert c["step_ends_s"] != a["step_ends_s"]


def test_simulations_in_processes_of_their_own_are_the_same_runs():
    """asyncflow.simulate.parallel: two plans of different shapes (each with its own keyword
    arguments), two processes, the results in order and equal to running them here."""
    from asyncflow.simulate.parallel import default_jobs, simulate_all

    runs = [(plan_of(*CONFIGS["longtail a=1"], 4), {"steps": 3}),
            (plan_of(*CONFIGS["W a=2 abort"], 5), {"max_events": 10_000_000})]
    here, there = simulate_all(runs, 1), simulate_all(runs, 2)
    for a, b in zip(here, there):
        a, b = a.to_dict(), b.to_dict()
        for d in (a, b):
            d.pop("wall_s"), d.pop("events_per_s")
        assert a == b
    assert [r.steps for r in there] == [3, 5] and there[1].aborted == here[1].aborted
    # a process running other threads (a Ray client, a logger) starts them from a fork server
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        served = simulate_all(runs[:1] * 2, 2)
    finally:
        stop.set()
        th.join()
    assert [r.step_ends for r in served] == [here[0].step_ends] * 2
    assert default_jobs(1) == 1 and 1 <= default_jobs(64) <= (os.cpu_count() or 1)


def test_compiles_estimate_simulates_the_plan_and_its_sync_form_at_once_with_the_same_figures(
        monkeypatch):
    """asyncflow/simulate/estimate.py: above PARALLEL_SAMPLES the plan and its synchronous form
    are simulated in two processes; the estimate is the one simulating them here gives."""
    from asyncflow.simulate import estimate

    plan = plan_of(LONGTAIL, ["sync.0.max_staleness=2"], 8)
    got = {}
    for limit in (10 ** 12, 1):  # one after the other here, then always at once
        monkeypatch.setattr(estimate, "PARALLEL_SAMPLES", limit)
        e = estimate.simulated(plan, LONGTAIL, ["sync.0.max_staleness=2"])
        got[limit] = (e.samples_per_s, e.samples_per_s_sync, e.step_time, e.bottleneck)
    assert got[1] == got[10 ** 12]
    assert got[1][0] > 1.15 * got[1][1]  # staleness 2 hides the long tail


@pytest.mark.parametrize("name", ["longtail a=1", "first_ready+continue", "redundancy 1.5",
                                  "schedule batch", "W pareto redundancy 1.5"])
def test_a_free_task_read_by_whole_groups_is_woken_per_group_and_runs_the_same(name, monkeypatch):
    """core._group_fed: the reward (no cost, read only by the advantage, whole groups) reads a
    group's rows once its last is written instead of each row as it is: the same run, fewer
    events; a task another reads by row (PPO's GAE) keeps per-row reads."""
    from asyncflow.simulate import core

    path, sets = CONFIGS[name]
    plan = plan_of(path, sets, 6)
    grouped = Simulation(plan)
    spp = plan.step.samples_per_prompt
    assert [w.unit for w in grouped.by_task["score"]] == [spp] * len(grouped.by_task["score"])
    a = grouped.run()
    monkeypatch.setattr(core, "_group_fed", lambda *args: [])
    b = simulate(plan)
    for key in ("step_ends", "samples", "staleness_max", "staleness_mean", "drops", "cancelled",
                "aborted"):
        assert getattr(a, key) == getattr(b, key), key
    # (a whole-batch rollout writes whole groups at once: nothing to save there)
    assert a.events < b.events if name != "schedule batch" else a.events == b.events
    ppo = Simulation(plan_of(PPO, PPO_SIM, 4))
    assert not any(w.unit for w in ppo.workers if w.task.kind == "reward")
