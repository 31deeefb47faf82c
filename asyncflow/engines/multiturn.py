"""Multi-turn (agentic) rollouts: drive one text environment per sample, engine-agnostic.

A rollout task with ``env: module:factory`` (:mod:`asyncflow.envs`) runs *episodes* instead of
single responses. The engine supplies only a sampler and its tokenizer:

    sample(prefixes: list[list[int]]) -> (tokens: list[list[int]], logprobs: list[list[float]])

which continues each token-id prefix by one agent turn (its new ids, stopping after ``eos`` or
``max_new_tokens``, and the sampling log-prob of each). :func:`run_episodes` then, for a batch of
rows:

1. builds one environment per row (``factory(**env_args)``) and calls ``reset(prompt, *context)``
   (the rollout task's inputs in their declared order: the prompt, then the rest); the first
   observation is the prompt: ``prompt_ids = [bos] + encode(observation)`` (no ``bos`` when the
   tokenizer has none);
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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from asyncflow.tokens import Text

Sampler = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]]]]

DEFAULT_MAX_TURNS = 16  # the cap when the task's args give no ``max_turns``


@dataclass
class Episode:
    """One episode in the layout of the module docstring."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # one per agent turn
    done: bool = False  # the environment ended it (False: stopped by max_turns)

    @property
    def turns(self) -> int:
        return len(self.rewards)

    @property
    def ret(self) -> float:
        """The episode return: the sum of its step rewards."""
        return float(sum(self.rewards))

    def text(self, tokenizer) -> Text:
        return Text(tokenizer.decode(self.ids), self.ids, self.prompt_ids, self.mask)


def resolve_factory(target: str | Callable, paths=()) -> Callable:
    """``"module:factory"`` (or a callable, returned as is) -> the callable; ``paths`` are
    searched before ``sys.path`` (:func:`asyncflow.refs.resolve`)."""
    if callable(target):
        return target
    from asyncflow.refs import resolve

    return resolve(str(target), paths)


def accepted_kwargs(fn: Callable, args: dict | None) -> dict:
    """The ``args`` that ``fn`` accepts as keywords (:func:`asyncflow.refs.accepted`)."""
    from asyncflow.refs import accepted

    return accepted(fn, args)


def _prompt_ids(tokenizer, observation) -> list[int]:
    if isinstance(observation, Text) and observation.ids:
        return list(observation.ids)
    bos = tokenizer.bos_id
    return ([bos] if bos is not None else []) + list(tokenizer.encode(str(observation)))


def run_episodes(rows: list[tuple], sample: Sampler, tokenizer, make_env: Callable[[], Any],
                 max_turns: int = DEFAULT_MAX_TURNS) -> list[Episode]:
    """Run one episode per row (see the module docstring): ``rows`` holds each episode's
    ``reset`` arguments; all active episodes are sampled together, one batched ``sample`` call
    per turn."""
    envs = [make_env() for _ in rows]
    episodes = [Episode(_prompt_ids(tokenizer, env.reset(*row))) for env, row in zip(envs, rows)]
    active = list(range(len(rows)))
    for turn in range(1, max(int(max_turns), 0) + 1):
        if not active:
            break
        tokens, logprobs = sample([episodes[i].prompt_ids + episodes[i].ids for i in active])
        still = []
        for i, act, lps in zip(active, tokens, logprobs, strict=True):
            ep = episodes[i]
            act, lps = list(act), [float(x) for x in lps]
            if len(lps) != len(act):
                raise ValueError(f"sampler returned {len(lps)} log-probs for {len(act)} tokens")
            ep.ids += act
            ep.mask += [1] * len(act)
            ep.logprobs += lps
            observation, reward, done = envs[i].step(tokenizer.decode(act))
            ep.rewards.append(float(reward))
            if done:
                ep.done = True
                continue
            if turn == max_turns:
                continue
            obs = list(tokenizer.encode(str(observation)))
            ep.ids += obs
            ep.mask += [0] * len(obs)
            ep.logprobs += [0.0] * len(obs)
            still.append(i)
        active = still
    return episodes


def rollout_columns(batch: dict, sample: Sampler, tokenizer, env: str | Callable,
                    env_args: dict | None = None, max_turns: int = DEFAULT_MAX_TURNS,
                    outputs=("response", "logprobs"), paths=()) -> dict[str, list]:
    """A rollout task's output columns for ``batch`` (keyed by role: ``prompt``, and
    ``context``, one tuple of further inputs per row): ``response`` (masked
    :class:`~asyncflow.tokens.Text`), ``logprobs`` (per token), and ``reward`` (the episode
    return) when it is one of ``outputs``. ``env_args`` are passed to the factory as the
    keywords it accepts; ``paths``: where the factory's module is looked up first."""
    factory = resolve_factory(env, paths)
    kwargs = accepted_kwargs(factory, env_args)
    prompts = batch["prompt"]
    context = batch.get("context") or [()] * len(prompts)
    rows = [(p, *c) for p, c in zip(prompts, context)]
    episodes = run_episodes(rows, sample, tokenizer, lambda: factory(**kwargs), max_turns)
    cols = {"response": [ep.text(tokenizer) for ep in episodes],
            "logprobs": [list(ep.logprobs) for ep in episodes],
            "reward": [ep.ret for ep in episodes]}
    return {o: cols[o] for o in (outputs or ("response", "logprobs"))}
