"""alpha = 0 is bit-identical to a plain synchronous loop (DESIGN.md, "Semantics that must be
exact": "alpha = 0 must give results identical, sample for sample and bit for bit under a fixed
seed, to the synchronous plan").

The runtime (local backend: worker threads, sample store, staleness gate, real weight sync through
the control plane's board) runs ``pipelines/grpo_digits.yaml`` shrunk with ``--set``-style
overrides and ``max_staleness: 0``. The test then runs the synchronous plan by hand: the same
:class:`~asyncflow.engines.hf.HFEngine` instances the workers build (same
:func:`asyncflow.runtime.worker.engine_spec`), one step at a time -- generate the step's rows
(prompt ``k`` of the data source replicated ``samples_per_prompt`` times, in row order), reward
with :func:`asyncflow.rewards.digits_match`, GRPO advantages with :func:`asyncflow.algos.estimate`,
reference log-probs, ``train_step``, ``update_weights(export_weights())``.

Every tensor of the final policy (trainer and rollout replica) must be ``torch.equal``; so must
each step's loss and the rollouts' responses.
"""
from __future__ import annotations

import os

import pytest

from asyncflow.compiler.pipeline import compile_file
from asyncflow.runtime.driver import Driver, load_prompts
from asyncflow.runtime.worker import engine_spec

torch = pytest.importorskip("torch")

PIPELINE = os.path.join(os.path.dirname(__file__), os.pardir, "pipelines", "grpo_digits.yaml")
STEPS = 3
SETS = [
    f"step.steps={STEPS}", "step.prompts_per_step=2", "step.samples_per_prompt=4",
    "sync.0.max_staleness=0",
    # bit-identical to a loop of generate/train_step calls: whole batches per rollout call, one
    # train_step per step (streaming equals it up to summation order: tests/test_scheduling_run.py)
    "tasks.generate.schedule=batch", "tasks.update.stream=false",
    "models.policy.args.layers=1", "models.policy.args.hidden=16",
    "data.prompts.args.n=64",
    "tasks.generate.args.max_new_tokens=4",
    # two micro-batches per step: gradient accumulation is part of what must match
    "tasks.update.args.micro_batch=4",
    # shaped reward: an untrained tiny model never matches exactly, and all-zero advantages
    # would leave the weights (and this test) untouched
    "tasks.score.args.partial=true",
]


def _plan(via: str = "store"):
    return compile_file(PIPELINE, sets=[*SETS, f"sync.0.via={via}"])


def _sync_loop(plan):
    """The synchronous plan, written out: returns (trainer, rollout, per-step losses,
    per-step responses)."""
    from asyncflow.algos import estimate
    from asyncflow.engines.hf import HFEngine
    from asyncflow.rewards import digits_match

    gen = HFEngine(engine_spec(plan, plan.task("generate"), 0))
    ref = HFEngine(engine_spec(plan, plan.task("ref"), 0))
    upd = HFEngine(engine_spec(plan, plan.task("update"), 0))
    prompts = load_prompts(plan)
    st = plan.step
    losses, responses = [], []
    for s in range(st.steps):
        cols = {"prompt": [], "answer": []}
        groups = []
        for k in range(s * st.prompts_per_step, (s + 1) * st.prompts_per_step):
            p = prompts[k % len(prompts)]
            cols["prompt"] += [p["prompt"]] * st.samples_per_prompt
            cols["answer"] += [p["answer"]] * st.samples_per_prompt
            groups += [k] * st.samples_per_prompt
        out = gen.generate({"prompt": cols["prompt"]})
        cols.update(out)
        rewards = [digits_match(p, a, r, partial=True) for p, a, r in
                   zip(cols["prompt"], cols["answer"], cols["response"])]
        cols["advantages"] = estimate("grpo", rewards, groups)
        cols.update(ref.logprobs({"prompt": cols["prompt"], "response": cols["response"]}))
        batch = {f: cols[f] for f in plan.task("update").inputs}
        metrics = upd.train_step(batch)
        losses.append(float(metrics["loss"]))
        responses.append([list(r.ids) for r in cols["response"]])
        gen.update_weights(upd.export_weights(), s + 1)
    return upd, gen, losses, responses


def _worker(driver, task):
    return next(w for wid, w in driver.backend.workers.items() if w.task.name == task)


@pytest.mark.engine
@pytest.mark.parametrize("via", ["store", "collective"])
def test_alpha0_weight_sync_is_bit_identical_to_sync_loop(via):
    # engines are built concurrently by the worker threads: asyncflow.models serialises the
    # seeded model builds and transformers' lazy imports (without that, this test failed)
    plan = _plan(via)
    assert plan.sync[0].max_staleness == 0 and plan.sync[0].via == via
    driver = Driver(plan, "local")
    result = driver.run()
    assert [m["step"] for m in result.metrics] == list(range(STEPS))
    assert all(m["staleness_max"] == 0 for m in result.metrics)

    # the runtime's final weights: the trainer's engine, and what the rollout adopted
    rt_train = _worker(driver, "update").engine.export_weights()
    rt_gen = _worker(driver, "generate").engine
    # the last version may be published after the rollout's last request (nothing left to
    # generate), so it may end on STEPS - 1; its per-step responses are compared below
    assert rt_gen.version in (STEPS - 1, STEPS)
    rt_gen_w = rt_gen.export_weights() if rt_gen.version == STEPS else None
    # the board's newest version is what the rollout adopted: the weights themselves (store),
    # or the trainer's collective endpoint, which serves its newest snapshot
    version, box = driver.control.board._latest["policy"]
    assert version == STEPS
    if via == "store":
        published = box[0]["store"]
    else:
        assert set(box[0]) == {"collective"} and box[0]["collective"]["version"] == STEPS
        sender = _worker(driver, "update").publisher.senders["policy"]
        published = sender.latest()[1]
        assert sender.served and all(r["backend"] == "gloo" for r in sender.served)

    # rollouts the runtime generated, per step, in row order (from the store's snapshot)
    sps = plan.step.samples_per_step
    col = driver.store.snapshot()["fields"]["response"]
    by_row = dict(zip(col["rows"], col["values"]))
    rt_resp = [[list(by_row[r].ids) for r in range(s * sps, (s + 1) * sps)]
               for s in range(STEPS)]

    upd, gen, losses, responses = _sync_loop(plan)
    want = upd.export_weights()

    for s in range(STEPS):
        assert rt_resp[s] == responses[s], f"step {s}: rollouts differ"
    assert [m["loss"] for m in result.metrics] == losses  # exact float equality
    assert set(rt_train) == set(want)
    for name, t in want.items():
        assert torch.equal(rt_train[name], t), f"trainer tensor {name} differs"
        if rt_gen_w is not None:
            assert torch.equal(rt_gen_w[name], t), f"rollout tensor {name} differs"
        assert torch.equal(published[name], t), f"published tensor {name} differs"
    # and training moved the weights (the comparison is not vacuous)
    init = type(upd)(engine_spec(plan, plan.task("update"), 0)).export_weights()
    assert any(not torch.equal(init[n], want[n]) for n in want)
