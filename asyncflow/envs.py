"""Text environments for multi-turn (agentic) rollouts (pure Python).

An environment factory (``module:factory``) returns a fresh environment per sample:

- ``reset(prompt, *context) -> str``: start an episode; called with the rollout task's inputs in
  their declared order (the prompt first); returns the first observation;
- ``step(action) -> (observation, reward, done)``: the agent's text for this turn; the next
  observation is appended to the dialogue when not ``done``.

The episode's return is the sum of its step rewards. Environments are deterministic: any
randomness is seeded from the row itself (never from Python's salted ``hash``).

A rollout task names the factory as ``env:``; the factory is called with those of the task's
``args`` it accepts as keywords (``max_turns``, ``max_operand``, ``stop_on_error`` for
:func:`digits_dialogue`; the engine's own args such as ``max_new_tokens`` are left out).
:mod:`asyncflow.engines.multiturn` runs the episodes; a ``reset`` that accepts an ``episode``
keyword gets the row's episode key from it (its ``_row``).

Two factories:

- :func:`digits_dialogue`: a running-sum dialogue over a digits problem (:class:`DigitsDialogue`).
- :func:`sim_env`: a tool or sandbox with modelled latency and failures (:class:`SimEnv`), for
  measuring schedules; its args:

  ===============  ==========================================================  =========
  arg              meaning                                                     default
  ===============  ==========================================================  =========
  ``turns``        agent turns of an episode: the ``turns``-th step is done    3
  ``latency``      seconds one step sleeps: a number or a distribution         0.05
                   (``{dist, ..., seed}``, :mod:`asyncflow.costmodel`, as the
                   sim engine's ``latency``)
  ``env_latency``  the step latency instead of ``latency`` when given (on the  None
                   sim engine a rollout's ``latency`` arg is also the agent
                   turn's device time, and both reach the factory)
  ``fail_rate``    probability that a step fails like a tool error             0.0
  ``seed``         seeds the latency, failure and target draws                 0
  ``time_scale``   multiplies every sleep (the sim engine's own ``time_scale``  1.0
                   when the runtime passes none)
  ===============  ==========================================================  =========
"""
from __future__ import annotations

import random
import threading
import time
import zlib
from typing import Any

from asyncflow.rewards import digits_match


class DigitsDialogue:
    """A running-sum dialogue over a digits problem (``reset("3+4=", "7")``: prompt, answer).

    Turn 1 asks the row's prompt. Each later turn asks to add one more number to the previous
    *correct* total (``" +5="``), so the agent must use the dialogue history. A right answer
    earns ``1 / max_turns``; a wrong one ends the episode (``stop_on_error``) or is corrected
    in the next observation (``" no, 7. +5="``). The episode ends after ``max_turns`` turns."""

    def __init__(self, max_turns: int = 3, max_operand: int = 9, stop_on_error: bool = True):
        self.max_turns = max_turns
        self.max_operand = max_operand
        self.stop_on_error = stop_on_error
        self.turn = 0
        self.total = 0
        self._rng = random.Random(0)

    def reset(self, prompt: str, answer: str) -> str:
        prompt, answer = str(prompt), str(answer)
        self._rng = random.Random(zlib.crc32(f"{prompt}\x00{answer}".encode()))
        self.turn, self.total = 0, int(answer)
        return prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.turn >= self.max_turns:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.turn += 1
        right = digits_match("", str(self.total), action, partial=False) == 1.0
        reward = 1.0 / self.max_turns if right else 0.0
        if self.turn >= self.max_turns or (not right and self.stop_on_error):
            return "", reward, True
        k = self._rng.randint(0, self.max_operand)
        hint = "" if right else f" no, {self.total}."
        self.total += k
        return f"{hint} +{k}=", reward, False


def digits_dialogue(max_turns: int = 3, max_operand: int = 9,
                    stop_on_error: bool = True) -> DigitsDialogue:
    """A fresh :class:`DigitsDialogue` (the factory a pipeline names)."""
    return DigitsDialogue(max_turns=max_turns, max_operand=max_operand,
                          stop_on_error=stop_on_error)


class SimEnv:
    """A tool or sandbox with modelled latency and failures (the args: the module docstring).

    ``reset(prompt, *context, episode=None)`` returns ``"<prompt> find <d>:"``: the task of turn
    1 is to name the digit ``d``. Each ``step(action)`` sleeps a latency drawn from ``latency``
    (times ``time_scale``), then:

    ===========  =========================================  ====================================
    outcome      observation                                reward
    ===========  =========================================  ====================================
    success      ``" ok. find <d'>:"``                      ``1 / turns`` when the action
                                                            contains the turn's digit, else 0
    failure      ``" error: tool failed. find <d'>:"``      0, whatever the action
    ===========  =========================================  ====================================

    (``d'``: the next turn's digit). The ``turns``-th step is ``done``; its observation is
    ``" ok."`` or ``" error: tool failed."``. A failure, with probability ``fail_rate``, models
    a tool or sandbox error: it takes its latency like a success, and the episode goes on with
    the next turn. The return is in [0, 1].

    **Determinism.** A step's latency, whether it fails, and each turn's digit depend only on
    (``seed``, the latency distribution's ``seed``, the episode key, the turn). The key is the
    ``episode`` keyword the schedulers pass (the row's ``_row``); without one it is the crc32 of
    the reset arguments and how many episodes with those arguments this process reset before
    (so the members of a GRPO group differ; that count follows the order of the resets).
    ``failures`` counts this episode's failed steps, ``latencies`` holds each step's modelled
    seconds (before ``time_scale``)."""

    _counts: dict = {}  # (seed, crc of the reset arguments) -> episodes reset so far
    _counts_lock = threading.Lock()

    def __init__(self, turns: int = 3, latency: Any = 0.05, fail_rate: float = 0.0,
                 seed: int = 0, time_scale: float = 1.0, env_latency: Any = None):
        from asyncflow.costmodel import Distribution

        self.turns = int(turns)
        if self.turns < 1:
            raise ValueError(f"sim_env: turns must be >= 1, not {turns!r}")
        self.fail_rate = float(fail_rate)
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"sim_env: fail_rate must be in [0, 1], not {fail_rate!r}")
        self.latency = Distribution.from_spec(latency if env_latency is None else env_latency)
        self.seed = int(seed)
        self.time_scale = float(time_scale)
        self.episode: Any = None
        self.turn = 0
        self.failures = 0
        self.latencies: list[float] = []

    def _rng(self, what: str, turn: int) -> random.Random:
        # str seeding hashes with SHA-512: stable across processes and Python versions
        return random.Random(f"sim_env:{what}:{self.seed}:{self.latency.seed}:"
                             f"{self.episode}:{turn}")

    def _digit(self, turn: int) -> int:
        return self._rng("target", turn).randrange(10)

    def reset(self, prompt: Any, *context: Any, episode: Any = None) -> str:
        if episode is None:
            crc = zlib.crc32("\x00".join(map(str, (prompt, *context))).encode())
            with SimEnv._counts_lock:
                n = SimEnv._counts.get((self.seed, crc), 0)
                SimEnv._counts[(self.seed, crc)] = n + 1
            episode = f"{crc}#{n}"
        self.episode, self.turn, self.failures, self.latencies = episode, 0, 0, []
        return f"{prompt} find {self._digit(1)}:"

    def step_seconds(self, turn: int) -> float:
        """Modelled seconds of step ``turn`` (1-based) of this episode, before ``time_scale``
        (``asyncflow simulate`` reads them without stepping)."""
        return max(0.0, self.latency.sample(self._rng("latency", turn)))

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.episode is None:
            raise RuntimeError("step() before reset()")
        if self.turn >= self.turns:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.turn += 1
        t = self.turn
        seconds = self.step_seconds(t)
        self.latencies.append(seconds)
        if seconds * self.time_scale > 0:
            time.sleep(seconds * self.time_scale)
        failed = self.fail_rate > 0 and self._rng("fail", t).random() < self.fail_rate
        if failed:
            self.failures += 1
            observation, reward = " error: tool failed.", 0.0
        else:
            right = str(self._digit(t)) in str(action)
            observation, reward = " ok.", (1.0 / self.turns if right else 0.0)
        done = t >= self.turns
        if not done:
            observation += f" find {self._digit(t + 1)}:"
        return observation, reward, done


def sim_env(turns: int = 3, latency: Any = 0.05, fail_rate: float = 0.0, seed: int = 0,
            time_scale: float = 1.0, env_latency: Any = None) -> SimEnv:
    """A fresh :class:`SimEnv` (the factory a pipeline names)."""
    return SimEnv(turns=turns, latency=latency, fail_rate=fail_rate, seed=seed,
                  time_scale=time_scale, env_latency=env_latency)
