"""Multi-turn (agentic) rollouts: drive one text environment per sample, engine-agnostic.

A rollout task with ``env: module:factory`` (:mod:`asyncflow.envs`) runs *episodes* instead of
single responses. The engine supplies only a sampler and its tokenizer:

    sample(prefixes: list[list[int]]) -> (tokens: list[list[int]], logprobs: list[list[float]])

which continues each token-id prefix by one agent turn (its new ids, stopping after ``eos`` or
``max_new_tokens``, and the sampling log-prob of each). :func:`run_episodes` then, for a batch of
rows:

1. builds one environment per row (``factory(**env_args)``) and calls ``reset(prompt, *context)``
   (the rollout task's inputs in their declared order: the prompt, then the rest); the first
   observation (what ``reset`` returns) is the episode's prompt, encoded as every rollout
   encodes one (:func:`asyncflow.models.encode_prompt`: a list of ``{role, content}`` messages
   through the chat template, a string as is with the tokenizer's specials, e.g.
   ``[bos] + encode(observation)`` for the character tokenizer);
2. for turn ``1 .. max_turns``, samples the agent turn of *every still-active episode in one
   batch* (prefix = ``prompt_ids + ids so far``), decodes it (special tokens dropped) and calls
   ``env.step(text) -> (observation, reward, done)``. An episode ends when the environment says
   ``done`` or after ``max_turns`` agent turns; it is never sampled again. Otherwise the
   observation's ids (``encode(observation)``, no specials) are appended and the next turn
   continues after them.

Layout of one finished episode (the ``response`` column is a :class:`~asyncflow.tokens.Text`):

    prompt_ids = [bos] + obs_0                          (Text.prompt_ids: the reset observation)
    ids        = act_1 + obs_1 + act_2 + obs_2 + ... + act_T
    mask       = 1..1  + 0..0  + 1..1  + 0..0  + ... + 1..1
    logprobs   = lp_1  + 0..0  + lp_2  + 0..0  + ... + lp_T
    str(Text)  = decode(ids)                            (the dialogue after the prompt)
    reward     = r_1 + r_2 + ... + r_T                  (the episode return)

``act_t`` is exactly what the sampler returned for turn ``t`` (ending with ``eos`` when the agent
stopped, which then separates the turn from the next observation); ``obs_t`` the ids of the
observation after turn ``t``. The observation that comes with ``done`` is not appended (nothing
reads it). Mask 1 marks agent-generated tokens, which count in losses, token counts, KL and
entropy; mask 0 marks observation tokens, which the policy conditions on but is never trained to
produce (``torch_common.pack`` treats them as padding for the loss, not for attention). Their
log-probs are ``0.0`` placeholders so that every per-token list has one entry per response id.

Scorers and trainers recompute log-probs over ``prompt_ids + ids`` in one forward pass: the same
context the sampler saw at every agent token, so behaviour and recomputed log-probs agree.

Two schedules run the same episodes to the same layout (a rollout task's ``schedule:``):

- ``batch`` (lock-step, :func:`run_episodes` / :func:`rollout_columns`, the engine's
  ``generate``): one batched ``sample`` call per turn, then every active episode's ``step``; the
  next turn starts when the slowest step of the batch has returned. With ``pool`` (an
  executor) the resets and the steps of a turn run concurrently on it, otherwise one after
  another.
- ``queue`` (env-level asynchrony, :func:`serve_episodes`, the engine's ``serve``): each episode
  is its own state machine over a :class:`~asyncflow.engines.base.TurnServer`. Its reset and
  every step run on a thread pool, and the moment an observation arrives its next agent turn is
  submitted to the server; a finished episode is emitted at once. A slow environment step holds
  up only its own episode.

**Episode keys.** With ``keys`` (:func:`run_episodes`; :func:`serve_episodes` uses each row's
``_row``) an environment whose ``reset`` accepts an ``episode`` keyword gets the row's key, so
its randomness depends on the episode and not on the order episodes start in
(:func:`asyncflow.envs.sim_env`); a keyed sampler gets ``(key, turn)`` per prefix, which is also
the request key :func:`serve_episodes` submits, so a deterministic engine (the sim engine) gives
an episode the same turns under both schedules.
"""
from __future__ import annotations

import itertools
import queue
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from asyncflow.tokens import Text

Sampler = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]]]]

DEFAULT_MAX_TURNS = 16  # the cap when the task's args give no ``max_turns``
POLL_S = 0.002  # the longest serve_episodes waits between two ``pull`` calls


@dataclass
class Episode:
    """One episode in the layout of the module docstring."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # one per agent turn
    done: bool = False  # the environment ended it (False: stopped by max_turns)
    version: int | None = None  # the oldest policy version among its turns (None: not known)
    prompt_text: str | None = None  # the text of prompt_ids (after a chat template)

    @property
    def turns(self) -> int:
        return len(self.rewards)

    @property
    def ret(self) -> float:
        """The episode return: the sum of its step rewards."""
        return float(sum(self.rewards))

    def text(self, tokenizer) -> Text:
        return Text(tokenizer.decode(self.ids), self.ids, self.prompt_ids, self.mask,
                    prompt_text=self.prompt_text)

    def add_turn(self, act, logprobs, version: int | None = None) -> list[int]:
        """Append one agent turn (mask 1) generated under ``version``; returns its ids."""
        act, lps = list(act), [float(x) for x in logprobs]
        if len(lps) != len(act):
            raise ValueError(f"sampler returned {len(lps)} log-probs for {len(act)} tokens")
        self.ids += act
        self.mask += [1] * len(act)
        self.logprobs += lps
        if version is not None:
            self.version = int(version) if self.version is None else min(self.version,
                                                                          int(version))
        return act

    def add_step(self, result, turn: int, max_turns: int, tokenizer) -> bool:
        """Record the environment's ``(observation, reward, done)`` after agent turn ``turn``;
        append the observation (mask 0, log-prob 0.0) and return True when the episode goes on
        (not ``done`` and ``turn < max_turns``)."""
        observation, reward, done = result
        self.rewards.append(float(reward))
        if done:
            self.done = True
            return False
        if turn >= max_turns:
            return False
        obs = list(tokenizer.encode(str(observation)))
        self.ids += obs
        self.mask += [0] * len(obs)
        self.logprobs += [0.0] * len(obs)
        return True

    def outputs(self, tokenizer, names: Sequence[str]) -> dict:
        """This episode's value of each output role in ``names`` (``response``, ``logprobs``,
        ``reward``)."""
        out = {}
        for name in names:
            if name == "response":
                out[name] = self.text(tokenizer)
            elif name == "logprobs":
                out[name] = list(self.logprobs)
            elif name == "reward":
                out[name] = self.ret
            else:
                raise KeyError(f"a multi-turn rollout has no output {name!r} "
                               "(it makes response, logprobs and reward)")
        return out


def resolve_factory(target: str | Callable, paths=()) -> Callable:
    """``"module:factory"`` (or a callable, returned as is) -> the callable; ``paths`` are
    searched after ``sys.path`` (:func:`asyncflow.refs.resolve`)."""
    if callable(target):
        return target
    from asyncflow.refs import resolve

    return resolve(str(target), paths)


def accepted_kwargs(fn: Callable, args: dict | None) -> dict:
    """The ``args`` that ``fn`` accepts as keywords (:func:`asyncflow.refs.accepted`)."""
    from asyncflow.refs import accepted

    return accepted(fn, args)


def _episode(tokenizer, observation) -> Episode:
    """A new episode whose prompt is the first observation (:func:`asyncflow.models.encode_prompt`)."""
    if isinstance(observation, Text) and observation.ids:
        return Episode(list(observation.ids), prompt_text=str(observation))
    from asyncflow.models import encode_prompt

    ids, text = encode_prompt(tokenizer, observation)
    return Episode(list(ids), prompt_text=text)


def _reset(env, args: tuple, key: Any = None):
    """``env.reset(*args)``, with ``episode=key`` when there is a key and ``reset`` accepts it."""
    if key is not None:
        from asyncflow.refs import call_params

        params = call_params(env.reset)
        if params is not None and params.accepts("episode"):
            return env.reset(*args, episode=key)
    return env.reset(*args)


def _map(pool: Executor | None, fn: Callable, items: list) -> list:
    """``[fn(x) for x in items]``, concurrently on ``pool`` when given (results in order)."""
    if pool is None or len(items) <= 1:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def run_episodes(rows: list[tuple], sample: Callable, tokenizer, make_env: Callable[[], Any],
                 max_turns: int = DEFAULT_MAX_TURNS, keys: Sequence | None = None,
                 pool: Executor | None = None) -> list[Episode]:
    """Run one episode per row in lock-step (see the module docstring): ``rows`` holds each
    episode's ``reset`` arguments; all active episodes are sampled together, one batched
    ``sample`` call per turn, then all their environments step.

    ``keys``: one episode key per row (e.g. its ``_row``): ``reset`` gets ``episode=key`` when it
    accepts it, and ``sample`` is called as ``sample(prefixes, [(key, turn), ...])``.
    ``pool``: resets and each turn's steps run concurrently on it (the turn ends when the slowest
    step returns)."""
    envs = [make_env() for _ in rows]
    idx = list(range(len(rows)))
    first = _map(pool, lambda i: _reset(envs[i], tuple(rows[i]), keys[i] if keys else None), idx)
    episodes = [_episode(tokenizer, obs) for obs in first]
    active = idx
    for turn in range(1, max(int(max_turns), 0) + 1):
        if not active:
            break
        prefixes = [episodes[i].prompt_ids + episodes[i].ids for i in active]
        if keys is None:
            tokens, logprobs = sample(prefixes)
        else:
            tokens, logprobs = sample(prefixes, [(keys[i], turn) for i in active])
        acts = {i: episodes[i].add_turn(act, lps)
                for i, act, lps in zip(active, tokens, logprobs, strict=True)}
        results = _map(pool, lambda i: envs[i].step(tokenizer.decode(acts[i])), active)
        active = [i for i, res in zip(active, results)
                  if episodes[i].add_step(res, turn, max_turns, tokenizer)]
    return episodes


def rollout_columns(batch: dict, sample: Callable, tokenizer, env: str | Callable,
                    env_args: dict | None = None, max_turns: int = DEFAULT_MAX_TURNS,
                    outputs=("response", "logprobs"), paths=(), keys: Sequence | None = None,
                    pool: Executor | None = None) -> dict[str, list]:
    """A rollout task's output columns for ``batch`` (keyed by role: ``prompt``, and
    ``context``, one tuple of further inputs per row): ``response`` (masked
    :class:`~asyncflow.tokens.Text`), ``logprobs`` (per token), and ``reward`` (the episode
    return) when it is one of ``outputs``. ``env_args`` are passed to the factory as the
    keywords it accepts; ``paths``: where the factory's module is looked up first; ``keys`` and
    ``pool`` as :func:`run_episodes` takes them."""
    factory = resolve_factory(env, paths)
    kwargs = accepted_kwargs(factory, env_args)
    prompts = batch["prompt"]
    context = batch.get("context") or [()] * len(prompts)
    rows = [(p, *c) for p, c in zip(prompts, context)]
    episodes = run_episodes(rows, sample, tokenizer, lambda: factory(**kwargs), max_turns,
                            keys=keys, pool=pool)
    names = tuple(outputs or ("response", "logprobs"))
    per = [ep.outputs(tokenizer, names) for ep in episodes]
    return {o: [p[o] for p in per] for o in names}


# -- env-level asynchrony ----------------------------------------------------------------------

@dataclass
class _Live:
    """An episode in flight in :func:`serve_episodes`."""

    key: Any  # the episode key (its ``_row``)
    row: dict  # the bookkeeping it is emitted with: ``_row``, ``_group``
    env: Any
    args: tuple  # the reset arguments
    ep: Episode | None = None  # None until reset returned
    turn: int = 0  # agent turns submitted so far
    in_env: bool = True  # its reset or a step is running on the pool (else: a turn in the server)


def serve_episodes(pull: Callable[[int], dict | None], emit: Callable[[dict], Any], server,
                   tokenizer, env: str | Callable, env_args: dict | None = None,
                   max_turns: int = DEFAULT_MAX_TURNS, outputs=("response", "logprobs"),
                   paths=(), env_threads: int | None = None,
                   on_cancel: Callable[[list], Any] | None = None,
                   poll_s: float = POLL_S) -> int:
    """Run episodes as rows arrive, each its own state machine (env-level asynchrony, the module
    docstring); returns how many were emitted.

    ``pull(k)`` returns a role-keyed batch of at most ``k`` new rows (``prompt``, optional
    ``context``: one tuple of further inputs per row, ``_row``, ``_group``), ``{}`` when none is
    ready, or ``None`` when no more will come (then the episodes in flight finish and this
    returns); it may raise to stop (in-flight episodes are abandoned, their turns cancelled in
    ``server``). It is called at least every ``poll_s`` seconds, with ``k = 0`` when no episode
    can start. A batch may carry ``"_cancel"``: rows whose episodes stop at once: the turn they
    have queued or running in ``server`` is cancelled, a reset or step they have running on the
    pool finishes there and is thrown away, and they are never emitted (``on_cancel(rows)`` is
    called with those that were in flight).

    ``server`` is a :class:`~asyncflow.engines.base.TurnServer`; agent turn ``t`` of the episode
    of row ``r`` is submitted as ``key = (r, t)`` with the episode so far as its prefix. Resets
    and steps run on a pool of ``env_threads`` threads (default ``2 * server.slots``), which also
    caps the episodes in flight, so an episode's step never waits for a thread.

    A finished episode is emitted at once as ``{"_row", "_group"?, "_version", role: value}``
    for the roles in ``outputs`` (the same values :func:`rollout_columns` gives that row;
    ``_version``: the oldest version the server reported among its turns, left out when it ran
    none). ``emit``, ``pull`` and ``server`` are only called from the calling thread."""
    factory = resolve_factory(env, paths)
    kwargs = accepted_kwargs(factory, env_args)
    names = tuple(outputs or ("response", "logprobs"))
    threads = max(1, int(env_threads or 2 * max(1, int(server.slots))))
    live: dict[Any, _Live] = {}
    results: queue.Queue = queue.Queue()  # (episode, ok, value) from the pool
    pool = ThreadPoolExecutor(threads, thread_name_prefix="env")
    unnamed = itertools.count()  # keys of rows that come without a _row
    orphans = 0  # resets/steps still running on the pool for episodes cancelled meanwhile
    emitted = 0
    exhausted = False

    def on_pool(lv: _Live, fn: Callable, *args) -> None:
        def run():
            try:
                results.put((lv, True, fn(*args)))
            except BaseException as e:  # raised again in the calling thread
                results.put((lv, False, e))

        lv.in_env = True
        pool.submit(run)

    def submit_turn(lv: _Live) -> None:
        lv.turn += 1
        lv.in_env = False
        server.submit((lv.key, lv.turn), lv.ep.prompt_ids + lv.ep.ids)

    def finish(lv: _Live) -> None:
        nonlocal emitted
        del live[lv.key]
        row = dict(lv.row)
        if lv.ep.version is not None:
            row["_version"] = lv.ep.version
        row.update(lv.ep.outputs(tokenizer, names))
        emit(row)
        emitted += 1

    def drop(key) -> None:
        nonlocal orphans
        lv = live.pop(key)
        if lv.in_env:
            orphans += 1
        elif lv.turn:
            server.cancel([(key, lv.turn)])

    def start(got: dict) -> None:
        cancel = [r for r in (got.get("_cancel") or ()) if r in live]
        for r in cancel:
            drop(r)
        if cancel and on_cancel is not None:
            on_cancel(cancel)
        prompts = got.get("prompt") or []
        context = got.get("context") or [()] * len(prompts)
        rows = got.get("_row") or [None] * len(prompts)
        groups = got.get("_group")
        for i, (p, c, r) in enumerate(zip(prompts, context, rows)):
            key = int(r) if r is not None else next(unnamed)
            if key in live:  # the row again (a lease issued anew): it starts over
                drop(key)
            row = {"_row": key}
            if groups is not None:
                row["_group"] = groups[i]
            lv = live[key] = _Live(key, row, factory(**kwargs), (p, *tuple(c)))
            on_pool(lv, _reset, lv.env, lv.args, key)

    def env_done(lv: _Live, ok: bool, value) -> None:
        nonlocal orphans
        if live.get(lv.key) is not lv:  # cancelled while its reset or step ran
            orphans -= 1
            return
        if not ok:
            raise value
        if lv.ep is None:  # the reset: the first observation
            lv.ep = _episode(tokenizer, value)
            goes_on = max_turns >= 1
        else:
            goes_on = lv.ep.add_step(value, lv.turn, max_turns, tokenizer)
        if goes_on:
            submit_turn(lv)
        else:
            finish(lv)

    def turn_done(key, ids, logprobs, version) -> None:
        r, turn = key
        lv = live.get(r)
        if lv is None or lv.in_env or lv.turn != turn:  # cancelled meanwhile
            return
        act = lv.ep.add_turn(ids, logprobs, version)
        on_pool(lv, lv.env.step, tokenizer.decode(act))

    def drain(timeout: float) -> bool:
        try:
            item = results.get(timeout=timeout) if timeout > 0 else results.get_nowait()
        except queue.Empty:
            return False
        env_done(*item)
        while True:
            try:
                env_done(*results.get_nowait())
            except queue.Empty:
                return True

    try:
        while True:
            if not exhausted:
                got = pull(max(0, threads - len(live) - orphans))
                if got is None:
                    exhausted = True
                elif got:
                    start(got)
            if exhausted and not live:
                return emitted
            stepped = drain(0.0)
            if server.in_flight():
                for key, ids, lps, version in server.poll(0.0 if stepped else poll_s):
                    turn_done(key, ids, lps, version)
            elif not stepped:
                drain(poll_s)
    finally:
        if live:
            server.cancel([(lv.key, lv.turn) for lv in live.values() if lv.turn and not lv.in_env])
        pool.shutdown(wait=False, cancel_futures=True)
