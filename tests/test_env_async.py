"""Env-level asynchrony for multi-turn rollouts (``schedule: queue``): each episode advances on its
own, a slow environment step holds up only its episode; the lock-step schedule (``batch``) gives
the same rows; ``_cancel``; the sim environment's failures and determinism; oldest versions."""
from __future__ import annotations

import threading
import time

import pytest

from asyncflow.engines import multiturn, sim_turns
from asyncflow.engines.base import EngineSpec, TurnServer
from asyncflow.engines.sim import SimEngine
from asyncflow.envs import SimEnv, sim_env
from asyncflow.models import CharTokenizer
from asyncflow.tokens import Text

TOK = CharTokenizer()
LONGTAIL = {"dist": "lognormal", "median": 0.2, "sigma": 1.0, "max": 3.0, "seed": 1}


def engine(env="asyncflow.envs:sim_env", env_args=None, outputs=("response", "logprobs", "reward"),
           **args) -> SimEngine:
    args = {"slots": 4, "latency": 0.1, "response_tokens": 3, "time_scale": 0.01, **args}
    return SimEngine(EngineSpec(task="generate", kind="rollout", model={"name": "policy"},
                                args=args, inputs=("prompt",), outputs=tuple(outputs),
                                extra={"env": env, "env_args": dict(env_args or {})}))


def batch(rows, group=4):
    return {"prompt": [f"{r % 7}+{r % 3}=" for r in rows], "_row": list(rows),
            "_group": [r // group for r in rows]}


def once(cols):
    """A ``pull`` that hands out ``cols`` on its first call, then reports no more rows."""
    state = {"given": False}

    def pull(k):
        if state["given"]:
            return None
        state["given"] = True
        return cols

    return pull


def serve(eng, cols):
    """(emitted rows by _row, emit wall time by _row, seconds) of ``eng.serve`` over ``cols``."""
    out, at = {}, {}
    t0 = time.monotonic()

    def emit(row):
        out[row["_row"]] = row
        at[row["_row"]] = time.monotonic() - t0

    n = eng.serve(once(cols), emit)
    assert n == len(out)
    return out, at, time.monotonic() - t0


class SlowOne:
    """An environment whose step 1 of episode ``slow`` takes ``seconds``; every other step is
    instant. Records the wall time each step started, per episode and turn."""

    starts: dict = {}
    lock = threading.Lock()

    def __init__(self, slow=0, seconds=0.4, turns=3):
        self.slow, self.seconds, self.turns = slow, seconds, turns

    def reset(self, prompt, episode=None):
        self.episode, self.turn = episode, 0
        return str(prompt)

    def step(self, action):
        self.turn += 1
        with SlowOne.lock:
            SlowOne.starts[(self.episode, self.turn)] = time.monotonic()
        if self.episode == self.slow and self.turn == 1:
            time.sleep(self.seconds)
        return " ok.", 1.0 if action else 0.0, self.turn >= self.turns


# ---------------------------------------------------------------------- asynchrony

def test_a_slow_env_step_holds_up_only_its_episode():
    rows = batch(range(6))
    # queue: the five fast episodes finish (three turns each) while episode 0's first step sleeps
    SlowOne.starts = {}
    eng = engine(env=SlowOne, env_args={"seconds": 0.4}, slots=8, time_scale=0.001)
    out, at, _ = serve(eng, rows)
    assert sorted(out) == list(range(6))
    slow_returned = SlowOne.starts[(0, 1)] + 0.4
    for r in range(1, 6):
        assert SlowOne.starts[(r, 3)] < slow_returned - 0.2  # its last step: long before
        assert at[r] < at[0]
    assert at[0] >= 0.4
    # lock-step: no episode's second turn starts before the slowest first step has returned
    SlowOne.starts = {}
    eng = engine(env=SlowOne, env_args={"seconds": 0.4}, slots=8, time_scale=0.001)
    eng.generate(rows)
    slow_returned = SlowOne.starts[(0, 1)] + 0.4
    for r in range(1, 6):
        assert SlowOne.starts[(r, 2)] >= slow_returned - 0.01


def test_queue_beats_lockstep_on_longtailed_env_latency():
    rows, scale = batch(range(16)), 0.1
    args = {"turns": 3, "latency": LONGTAIL}
    steps = []  # the modelled seconds of each episode's steps (keyed by _row, as served)
    for r in rows["_row"]:
        env = SimEnv(turns=3, latency=LONGTAIL, time_scale=0.0)
        env.reset("", episode=r)
        for _ in range(3):
            env.step("")
        steps.append(env.latencies)
    turn = 0.1  # one agent turn; 16 slots: a turn's batch takes one turn's time
    lockstep = sum(max(s[t] for s in steps) + turn for t in range(3))  # waits per turn
    queued = max(sum(s) + 3 * turn for s in steps)  # each episode on its own
    assert queued < 0.7 * lockstep
    eng = engine(env_args=args, slots=16, env_threads=16, time_scale=scale)
    t = time.monotonic()
    eng.generate(rows)
    lock = time.monotonic() - t
    _, _, queue = serve(engine(env_args=args, slots=16, env_threads=16, time_scale=scale), rows)
    assert lock >= 0.95 * lockstep * scale
    # measured side by side: both runs pay the same machine's overheads (a loaded CI machine
    # adds tenths of a second to each); the queue never waits less than its slowest episode
    assert queued * scale * 0.95 <= queue < lock


# ---------------------------------------------------------------------- same rows either way

def test_outputs_equal_lockstep_for_the_same_rows():
    rows = batch(range(12))
    args = {"turns": 3, "latency": LONGTAIL, "fail_rate": 0.3, "seed": 5}
    cols = engine(env_args=args, slots=3).generate(rows)
    out, _, _ = serve(engine(env_args=args, slots=3), rows)
    assert sorted(out) == list(range(12))
    assert set(cols) == {"response", "logprobs", "reward"}
    for i, r in enumerate(rows["_row"]):
        got, want = out[r], cols["response"][i]
        assert set(got) == {"_row", "_group", "_version", "response", "logprobs", "reward"}
        assert got["_group"] == rows["_group"][i] and got["_version"] == 0
        resp = got["response"]
        assert isinstance(resp, Text) and str(resp) == str(want)
        assert resp.ids == want.ids and resp.prompt_ids == want.prompt_ids
        assert resp.mask == want.mask
        assert got["logprobs"] == cols["logprobs"][i]
        assert got["reward"] == cols["reward"][i]
        # the multi-turn layout: agent tokens (mask 1) end each turn with eos and carry
        # negative log-probs; observation tokens (mask 0) log-prob 0.0; the reset observation
        # is the prompt with the first task
        assert len(resp.ids) == len(resp.mask) == len(got["logprobs"])
        assert all((lp < 0) == (m == 1) for lp, m in zip(got["logprobs"], resp.mask))
        assert resp.prompt_ids[0] == TOK.bos_id
        first = TOK.decode(resp.prompt_ids)
        assert first.startswith(f"{rows['prompt'][i]} find ") and first.endswith(":")
        assert resp.ids.count(TOK.eos_id) == 3  # three turns, each ending with eos
        assert resp.ids[-1] == TOK.eos_id and resp.mask[-1] == 1
    assert {round(x, 6) for x in cols["reward"]} - {0.0} != set()  # some turns are rewarded


def test_layout_matches_run_episodes_for_a_keyed_sampler():
    """serve_episodes over any TurnServer gives what run_episodes gives with the same turns."""
    rows = [("3+4=",), ("2+2=",), ("1+0=",)]

    def turn(key):
        r, t = key
        ids = TOK.encode(str((r + t) % 10)) + [TOK.eos_id]
        return ids, [-(j + 1) / 10 for j in range(len(ids))]

    def sample(prefixes, keys):
        turns = [turn(k) for k in keys]
        return [a for a, _ in turns], [b for _, b in turns]

    make = lambda: sim_env(turns=3, latency=0.0, fail_rate=0.2, seed=3)  # noqa: E731
    eps = multiturn.run_episodes(rows, sample, TOK, make, max_turns=2, keys=[10, 11, 12])

    class Instant:
        slots = 2

        def __init__(self):
            self.q = []

        def submit(self, key, prefix_ids):
            self.q.append(key)

        def poll(self, timeout_s):
            done, self.q = self.q, []
            return [(k, *turn(k), 7) for k in done]

        def cancel(self, keys):
            return 0

        def in_flight(self):
            return len(self.q)

    assert isinstance(Instant(), TurnServer)
    out = []
    cols = {"prompt": [r[0] for r in rows], "_row": [10, 11, 12]}
    n = multiturn.serve_episodes(once(cols), out.append, Instant(), TOK, make, max_turns=2,
                                 outputs=("response", "logprobs", "reward"))
    assert n == 3
    by = {r["_row"]: r for r in out}
    for key, ep in zip([10, 11, 12], eps):
        row = by[key]
        assert row["_version"] == 7 and "_group" not in row
        assert row["response"] == ep.text(TOK)
        assert list(row["response"].ids) == ep.ids and list(row["response"].mask) == ep.mask
        assert list(row["response"].prompt_ids) == ep.prompt_ids
        assert row["logprobs"] == ep.logprobs and row["reward"] == ep.ret
        assert ep.turns == 2  # max_turns caps the 3-turn environment


# ---------------------------------------------------------------------- cancel

def test_cancel_stops_an_episode_and_frees_its_slot():
    # one slot, 0.2 s per agent turn, instant env, 2 turns: three episodes run 6 turns in series
    eng = engine(env_args={"turns": 2, "latency": 0.0}, slots=1, latency=1.0, time_scale=0.2,
                 max_turns=2)
    state = {"calls": 0, "t0": None, "cancelled_at": None, "row": None}

    def pull(k):
        state["calls"] += 1
        if state["calls"] == 1:
            state["t0"] = time.monotonic()
            return batch(range(3))
        running = list(eng.turn_server._running)
        if state["cancelled_at"] is None and running:
            time.sleep(0.05)  # the first turn to start is running in the only slot
            state["cancelled_at"] = time.monotonic()
            state["row"] = running[0][0]
            return {"_cancel": [state["row"]]}
        return {} if time.monotonic() - state["t0"] < 1.5 else None

    out = []
    eng.serve(pull, lambda row: out.append((row["_row"], time.monotonic())))
    assert sorted(r for r, _ in out) == sorted({0, 1, 2} - {state["row"]})  # never emitted
    assert eng.cancelled == 1 and eng.turn_server.cancelled == 1
    assert eng.turn_server.in_flight() == 0
    # the slot was freed at the cancel: the other rows need 4 turns (0.8 s) from then, not 1.0 s
    # (the cancelled turn run out) nor more (a second turn of the cancelled row)
    last = max(t for _, t in out) - state["cancelled_at"]
    assert 0.7 <= last < 0.95
    assert eng.turn_server.started == 5  # the cancelled turn, then 2 turns of each other row


def test_cancel_while_the_env_steps_throws_the_step_away():
    SlowOne.starts = {}
    eng = engine(env=SlowOne, env_args={"seconds": 0.3}, slots=4, time_scale=0.001)
    state = {"calls": 0, "sent": False}

    def pull(k):
        state["calls"] += 1
        if state["calls"] == 1:
            return batch(range(3))
        if not state["sent"] and (0, 1) in SlowOne.starts:
            state["sent"] = True
            return {"_cancel": [0, 99]}  # 99: not in flight, ignored
        if state["sent"] and time.monotonic() - SlowOne.starts[(0, 1)] > 0.5:
            return None
        return {}

    out = []
    eng.serve(pull, out.append)
    assert sorted(r["_row"] for r in out) == [1, 2]
    assert eng.cancelled == 1
    assert (0, 2) not in SlowOne.starts  # the thrown-away step started no further turn


def test_a_row_pulled_again_starts_over_and_is_emitted_once():
    SlowOne.starts = {}
    eng = engine(env=SlowOne, env_args={"seconds": 0.2}, slots=4, time_scale=0.001)
    state = {"calls": 0, "again": False}

    def pull(k):
        state["calls"] += 1
        if state["calls"] == 1:
            return batch(range(2))
        if not state["again"] and (0, 1) in SlowOne.starts:
            state["again"] = True  # row 0 again (its lease issued anew) while its step sleeps
            return batch([0])
        return {} if state["calls"] < 5 or eng.turn_server.in_flight() or len(out) < 2 else None

    out = []
    eng.serve(pull, out.append)
    assert sorted(r["_row"] for r in out) == [0, 1] and eng.cancelled == 0


def test_turn_server_cancel_frees_the_slot_for_the_next_request_at_once():
    eng = engine(slots=1, latency=1.0, time_scale=1.0)
    s = sim_turns.SimTurnServer(eng)
    s.submit((0, 1), [1])
    s.submit((1, 1), [1])
    assert (0, 1) in s._running and (1, 1) in s._queue and s.in_flight() == 2
    t = time.monotonic()
    assert s.cancel([(0, 1), ("x", 1)]) == 1
    finish, version = s._running[(1, 1)]
    assert abs(finish - (t + 1.0)) < 0.05 and version == 0  # started at the cancel
    assert s.cancel([(1, 1)]) == 1 and s.in_flight() == 0 and s.poll(0.0) == []


def test_turn_server_times_are_exact_slot_schedules():
    """Three requests through two slots finish as slot_schedule says, however often polled."""
    eng = engine(slots=2, latency={"dist": "uniform", "min": 0.5, "max": 1.5, "seed": 2},
                 time_scale=0.1)
    s = sim_turns.SimTurnServer(eng)
    keys = [(r, 1) for r in range(3)]
    lat = [sim_turns.turn_latency(eng, r, t) * 0.1 for r, t in keys]
    t0 = time.monotonic()
    for k in keys:
        s.submit(k, [])
    got = {}
    while len(got) < 3:
        time.sleep(0.07)  # coarse polling must not delay the third request's start
        for key, ids, lps, _ in s.poll(0.0):
            got[key] = time.monotonic()
            assert (ids, lps) == sim_turns.turn_tokens(eng, *key)
    from asyncflow.engines.sim import slot_schedule

    want = {keys[i]: f for f, i in slot_schedule(lat, 2)}
    for k in keys:
        assert want[k] <= got[k] - t0 < want[k] + 0.12  # found at most one poll late


# ---------------------------------------------------------------------- the sim environment

def failures(seed, episodes=range(40), fail_rate=0.5):
    pattern = []
    for e in episodes:
        env = sim_env(turns=5, latency=0.0, fail_rate=fail_rate, seed=seed)
        env.reset("1+1=", episode=e)
        pattern.append(tuple("error" in env.step("0123456789")[0] for _ in range(5)))
        assert env.failures == sum(pattern[-1])
    return pattern


def test_fail_rate_fails_deterministically_by_seed():
    a, b, c = failures(1), failures(1), failures(2)
    assert a == b and a != c
    rate = sum(map(sum, a)) / 200
    assert 0.35 < rate < 0.65
    assert not any(map(any, failures(1, fail_rate=0.0)))
    assert all(map(all, failures(1, fail_rate=1.0)))


def test_sim_env_steps_rewards_and_latency():
    env = SimEnv(turns=3, latency={"dist": "pareto", "scale": 0.01, "alpha": 1.5, "max": 0.5},
                 fail_rate=0.0, seed=4, time_scale=0.0)
    first = env.reset("3+4=", episode=7)
    digit = first.split("find ")[1].rstrip(":")
    assert first == f"3+4= find {digit}:"
    obs, reward, done = env.step(f"x{digit}")  # contains the digit: rewarded
    assert reward == pytest.approx(1 / 3) and not done and obs.startswith(" ok. find ")
    nxt = obs.split("find ")[1].rstrip(":")
    obs, reward, done = env.step("".join(d for d in "0123456789" if d != nxt))
    assert reward == 0.0 and not done
    obs, reward, done = env.step("0123456789")
    assert done and obs == " ok." and reward == pytest.approx(1 / 3)
    with pytest.raises(RuntimeError):
        env.step("1")
    assert len(env.latencies) == 3 and all(0.01 <= x <= 0.5 for x in env.latencies)
    # the same episode key draws the same latencies; another key others
    again = SimEnv(turns=3, latency={"dist": "pareto", "scale": 0.01, "alpha": 1.5, "max": 0.5},
                   seed=4, time_scale=0.0)
    again.reset("anything", episode=7)
    for _ in range(3):
        again.step("")
    assert again.latencies == env.latencies
    # without a key the n-th reset of the same arguments is its own episode
    x, y = SimEnv(latency=0.0), SimEnv(latency=0.0)
    x.reset("5+5="), y.reset("5+5=")
    assert x.episode != y.episode
    # env_latency replaces latency (a pipeline's latency is also the sim engine's)
    assert SimEnv(latency=0.3, env_latency=0.02).latency.mean() == 0.02
    with pytest.raises(ValueError):
        SimEnv(fail_rate=1.5)


def test_sim_env_sleeps_its_latency_scaled():
    env = sim_env(turns=1, latency=0.5, time_scale=0.2)
    env.reset("1+1=", episode=0)
    t = time.monotonic()
    env.step("")
    assert 0.09 <= time.monotonic() - t < 0.3
    # the sim engine hands its time_scale to a factory that takes one
    eng = engine(env_args={"turns": 1, "latency": 1.0}, time_scale=0.05, latency=0.0)
    t = time.monotonic()
    eng.generate(batch(range(2)))
    assert 0.045 <= time.monotonic() - t < 0.3


# ---------------------------------------------------------------------- versions, pull cadence

def test_version_is_the_oldest_among_the_turns():
    eng = engine(env_args={"turns": 3, "latency": 0.1}, slots=8, latency=0.01, time_scale=1.0)
    seen: dict = {}  # row -> versions of its turns, as the server reported them

    class Recording(sim_turns.SimTurnServer):
        def poll(self, timeout_s):
            done = super().poll(timeout_s)
            for (r, _), _, _, v in done:
                seen.setdefault(r, []).append(v)
            return done

    state = {"calls": 0, "t0": time.monotonic(), "late": False}

    def pull(k):
        state["calls"] += 1
        now = time.monotonic() - state["t0"]
        if state["calls"] == 1:
            return batch(range(4))
        if now > 0.05 and eng.version == 0:
            eng.update_weights(None, 1)  # rows 0-3: turn 1 done, turns 2 and 3 to come
        if eng.version == 1 and not state["late"]:
            state["late"] = True
            return batch(range(4, 8))
        return {} if now < 0.6 else None

    out = []
    multiturn.serve_episodes(pull, out.append, Recording(eng), sim_turns.tokenizer(),
                             sim_env, {"turns": 3, "latency": 0.1}, max_turns=3)
    by = {r["_row"]: r for r in out}
    assert sorted(by) == list(range(8))
    for r, row in by.items():
        assert row["_version"] == min(seen[r])
    assert all(seen[r] == [0, 1, 1] and by[r]["_version"] == 0 for r in range(4))
    assert all(seen[r] == [1, 1, 1] and by[r]["_version"] == 1 for r in range(4, 8))


def test_pull_is_called_every_few_ms_and_never_overfills():
    SlowOne.starts = {}
    eng = engine(env=SlowOne, env_args={"seconds": 0.3}, slots=2, env_threads=3,
                 time_scale=0.001)
    calls: list = []
    pending = list(range(6))

    def pull(k):
        calls.append((time.monotonic(), k))
        if not pending:
            return None
        take, pending[:] = pending[:k], pending[k:]
        return batch(take) if take else {}

    out = []
    eng.serve(pull, out.append)
    assert sorted(r["_row"] for r in out) == list(range(6))
    assert calls[0][1] == 3 and max(k for _, k in calls) <= 3  # env_threads caps episodes
    gaps = [b - a for (a, _), (b, _) in zip(calls, calls[1:])]
    assert max(gaps) < 0.05  # even while every episode waits on a slow step


# ---------------------------------------------------------------------- stopping and errors

def test_pull_raising_stops_and_cancels_what_is_in_flight():
    eng = engine(env_args={"turns": 3, "latency": 0.0}, slots=2, latency=1.0, time_scale=0.1)
    calls = {"n": 0}

    class Stop(Exception):
        pass

    def pull(k):
        calls["n"] += 1
        if calls["n"] == 1:
            return batch(range(4))
        if eng.turn_server.in_flight() >= 2:
            raise Stop()
        return {}

    out = []
    with pytest.raises(Stop):
        eng.serve(pull, out.append)
    assert out == [] and eng.turn_server.in_flight() == 0


def test_an_environment_error_is_raised_not_swallowed():
    class Broken:
        def reset(self, prompt):
            return prompt

        def step(self, action):
            raise OSError("sandbox gone")

    with pytest.raises(OSError, match="sandbox gone"):
        engine(env=Broken, time_scale=0.001).serve(once(batch(range(2))), lambda row: None)
    with pytest.raises(OSError, match="sandbox gone"):
        engine(env=Broken, time_scale=0.001).generate(batch(range(2)))
