"""AF4xx: findings of the compiler's passes (placement, staleness, overlap, cost).

The pass that reports each code is named in its comment. AF401 duplicates a rule validate also
enforces (pool capacity); placement reports it itself so that it never crashes on an infeasible
placement, but with validate in front its example is caught there first -- the compiler tests
check it against the placement pass alone.
"""
from asyncflow.diagnostics.code import Code, Example
from asyncflow.diagnostics.examples import BASE, mutate

CODES = [
    # placement, rule 2
    Code("AF401", "pool-too-small",
         "task '{task}' needs {need} devices ({replicas} replicas x {dpr} devices each) but pool "
         "'{pool}' has {devices}",
         (mutate("    pool: rollout\n", "    pool: rollout\n    replicas: 3\n", at="3\n"),)),
    # placement, rule 5
    Code("AF402", "pool-resource-reserved",
         "pool '{pool}': resources may not name '{key}' (the device kind sets GPU and CPU)",
         (mutate("  train: {devices: 1}", "  train: {devices: 1, resources: {GPU: 2}}", at="2}}"),)),
    # cost
    Code("AF403", "bad-latency", "task '{task}': bad latency: {reason}",
         (mutate("    args: {max_new_tokens: 8}",
                 "    args: {max_new_tokens: 8}\n    cost: {latency: {dist: gamma, shape: 2}}",
                 at="{dist: gamma"),
          mutate("    args: {max_new_tokens: 8}",
                 "    args: {max_new_tokens: 8}\n    cost: {latency: {dist: lognormal, sigma: 1}}",
                 at="{dist: lognormal"))),
    # cost
    Code("AF404", "bad-cost-hint",
         "task '{task}': '{key}' is not a cost hint (use {keys}, each a number >= 0; slots an "
         "integer >= 1)",
         (mutate("    args: {lr: 1.0e-4, micro_batch: 8}",
                 "    args: {lr: 1.0e-4, micro_batch: 8}\n    cost: {seconds_per_sampel: 0.01}",
                 at="0.01}"),
          mutate("    args: {max_new_tokens: 8}",
                 "    args: {max_new_tokens: 8}\n    cost: {slots: 0, seconds_per_sample: 1}",
                 at="0, seconds"))),
    # overlap, rule 3
    Code("AF405", "group-of-one",
         "estimator '{estimator}' normalises within a group, but samples_per_prompt is 1: every "
         "advantage is 0: nothing would learn", (mutate("  prompts_per_step: 4\n  samples_per_prompt: 4",
                                   "  prompts_per_step: 8\n  samples_per_prompt: 1", at="grpo"),)),
    # staleness
    Code("AF406", "staleness-never-binds",
         "max_staleness {alpha} is not below steps ({steps}): the trainer never holds the "
         "producer back", (mutate("max_staleness: 1", "max_staleness: 5", at="5}"),),
         severity="warning"),
    # placement, rule 7
    Code("AF407", "gpus-split-across-processes",
         "task '{task}' runs on {n} GPUs of pool '{pool}' that it time-shares with another "
         "process ({other}): Ray gives a process part of one GPU or whole GPUs, never part of "
         "several; give '{task}' a pool of its own, or every task on the pool the same "
         "devices_per_replica (with share_process: true)",
         (Example(BASE.replace("  train: {devices: 1}", "  train: {devices: 2}").replace(
             "    pool: train\n    loss: grpo",
             "    pool: train\n    devices_per_replica: 2\n    loss: grpo"),
             "2\n    loss: grpo", sets=("tasks.update.engine=deepspeed",)),)),
]
