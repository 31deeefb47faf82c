"""AF3xx: the language's rules (docs/language.md, "Rules the compiler enforces") and cross-references.

Reported by :mod:`asyncflow.compiler.passes.validate`. Grouped by tens:

=======  ===============================================================
AF30x    data flow: producers, consumers, cycles, ``keep``
AF31x    models: init / copy_of, frozen, who trains them
AF32x    pools, engines, and which keys each task kind needs; AF329: a first_ready buffer
         that ``on_update: finish`` defeats (a scheduling key, AF38x being full)
AF33x    estimators and losses
AF34x    ``module:function`` references and files
AF35x    weight-sync edges
AF36x    batch arithmetic and task ``args``
AF37x    bindings: each input's role and type (:mod:`asyncflow.compiler.passes.bind`)
AF38x    scheduling keys: schedule, redundancy, on_update, consume, stream, refill;
         AF384-AF389: the ``eval:`` section (:mod:`asyncflow.compiler.passes.evalplan`)
=======  ===============================================================
"""
from pathlib import Path

from asyncflow.diagnostics.code import Code, Example
from asyncflow.diagnostics.examples import BASE, mutate

_W = "warning"
# files the AF346 example points at (a chat data file; a model directory without a template)
_FIXTURES = Path(__file__).resolve().parents[2] / "compiler_tests" / "fixtures"


def _edit(*pairs, at: str) -> Example:
    """BASE with several replacements (a mistake that needs two edits to pass the earlier rules)."""
    text = BASE
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new, 1)
    return Example(text, at)


CODES = [
    # -- AF30x data flow ----------------------------------------------------------------------
    Code("AF301", "no-producer",
         "input '{field}' of task '{task}' has no producer: no data source or task outputs it",
         (mutate("    inputs: [reward]", "    inputs: [rewards]", at="rewards]"),
          mutate("    inputs: [prompt, response]\n", "    inputs: [prompt, respons]\n",
                 at="respons]"))),
    Code("AF302", "duplicate-producer", "field '{field}' is produced by both '{first}' and '{second}'",
         (mutate("    outputs: [ref_logprobs]", "    outputs: [logprobs]", at="logprobs]\n  advantage"),)),
    Code("AF303", "unused-output",
         "output '{field}' of task '{task}' is never used: consume it or list it in 'keep:'",
         (mutate("    outputs: [reward]", "    outputs: [reward, accuracy]", at="accuracy"),)),
    Code("AF304", "keep-not-output", "'keep' lists '{field}', which is not an output of task '{task}'",
         (mutate("    outputs: [reward]", "    outputs: [reward]\n    keep: [rewards]", at="rewards]"),)),
    Code("AF305", "data-cycle",
         "the data edges form a cycle ({cycle}); only a sync edge may go back",
         (mutate("    inputs: [prompt, answer, response]", "    inputs: [prompt, answer, response, advantages]",
                 at="advantages]"),)),
    Code("AF306", "name-clash", "task '{name}' has the name of a data source: tasks and sources share one namespace",
         (mutate("  score:", "  prompts:", at="prompts:\n    kind"),)),
    Code("AF307", "no-inputs", "task '{task}' reads nothing: list its 'inputs' (tasks pull rows from the store)",
         (mutate("    inputs: [reward]\n", "", at="advantage:\n"),)),
    Code("AF308", "no-outputs", "{what} '{name}' produces nothing: list its {key}",
         (mutate("    outputs: [ref_logprobs]", "    outputs: []", at="ref:"),)),
    Code("AF309", "unused-source-field", "field '{field}' of data source '{source}' is never read",
         (mutate("fields: [prompt, answer]", "fields: [prompt, answer, level]", at="level"),),
         severity=_W),
    # -- AF31x models -------------------------------------------------------------------------
    Code("AF310", "unknown-model", "there is no model '{name}'",
         (mutate("    model: reference", "    model: referance", at="referance"),
          mutate("    copy_of: policy", "    copy_of: polcy", at="polcy"))),
    Code("AF311", "model-no-init",
         "model '{model}' needs 'init' (\"module:factory\", a directory or a checkpoint) or 'copy_of'",
         (mutate("    init: asyncflow.models:tiny_decoder\n", "", at="policy:\n    args"),)),
    Code("AF312", "init-and-copy", "model '{model}' has both 'init' and 'copy_of': keep one",
         (mutate("    copy_of: policy", "    init: asyncflow.models:tiny_decoder\n    copy_of: policy",
                 at="policy\n    frozen"),)),
    Code("AF313", "copy-cycle", "models are copies of each other in a cycle ({cycle})",
         (mutate("    copy_of: policy", "    copy_of: reference", at="reference\n"),)),
    Code("AF314", "train-frozen", "task '{task}' trains model '{model}', which is frozen",
         (mutate("    model: policy\n    pool: train\n    loss: grpo",
                 "    model: reference\n    pool: train\n    loss: grpo", at="reference\n    pool: train\n    loss"),)),
    Code("AF315", "two-trainers", "model '{model}' is trained by both '{first}' and '{second}'",
         (mutate("  update:\n", "  update0:\n    kind: train\n    engine: hf\n    model: policy\n"
                 "    pool: train\n    loss: grpo\n    inputs: [prompt, response, advantages]\n  update:\n",
                 at="policy\n    pool: train\n    loss: grpo\n    inputs: [prompt, response, logprobs"),)),
    Code("AF316", "unused-model", "model '{model}' is not used by any task",
         (mutate("  reference:\n", "  critic:\n    init: asyncflow.models:tiny_decoder\n  reference:\n",
                 at="critic:"),), severity=_W),
    # -- AF32x pools, engines, task kinds -----------------------------------------------------
    Code("AF320", "unknown-pool", "there is no pool '{name}'",
         (mutate("    pool: rollout", "    pool: rolout", at="rolout"),)),
    Code("AF321", "not-enough-devices",
         "task '{task}' needs {need} devices per replica set (replicas {replicas} x devices_per_replica "
         "{dpr}) but pool '{pool}' has {devices}",
         (mutate("    pool: rollout\n", "    pool: rollout\n    replicas: 2\n", at="2\n    inputs"),)),
    Code("AF322", "unused-pool", "pool '{pool}' is not used by any task",
         (mutate("  train: {devices: 1}", "  train: {devices: 1}\n  spare: {devices: 2}", at="spare"),),
         severity=_W),
    Code("AF323", "unknown-engine", "there is no engine '{name}' (known: {known})",
         (mutate("    engine: hf\n    model: policy\n    pool: rollout",
                 "    engine: vlm\n    model: policy\n    pool: rollout", at="vlm"),)),
    Code("AF324", "engine-kind", "engine '{engine}' cannot run a {kind} task (it runs {kinds})",
         (mutate("    engine: hf\n    model: policy\n    pool: train\n    loss",
                 "    engine: vllm\n    model: policy\n    pool: train\n    loss", at="vllm"),)),
    Code("AF327", "train-replicas",
         "train task '{task}' has replicas {replicas}, but engine '{engine}' trains one copy of "
         "the model: the replicas would not split a step's rows (only engine deepspeed trains "
         "data-parallel)",
         (mutate("    loss: grpo\n    inputs: [prompt, response, logprobs, ref_logprobs, advantages]",
                 "    loss: grpo\n    replicas: 2\n    inputs: [prompt, response, logprobs, ref_logprobs, advantages]",
                 at="2\n    inputs: [prompt, response, logprobs, ref"),)),
    Code("AF328", "train-replicas-split",
         "train task '{task}' has replicas {replicas}: its replicas split each step by group, "
         "fixed in advance, but {why}, so a step's rows are chosen as they become ready",
         (_edit(("    engine: hf\n    model: policy\n    pool: train\n    loss: grpo",
                 "    engine: deepspeed\n    model: policy\n    pool: train\n    loss: grpo\n"
                 "    replicas: 2\n    consume: first_ready"),
                ("  train: {devices: 1}", "  train: {devices: 2}"),
                at="2\n    consume"),)),
    Code("AF329", "first-ready-drained",
         "on_update: finish{written} of rollout '{task}' defeats consume: first_ready of train "
         "task '{trainer}' with no spare group launched ({spare}): the rollout takes up new "
         "weights only once every sample in flight has finished, so each step still waits for "
         "the slowest sample, whichever rows it trains (simulated, benchmarks/scheduling.py's "
         "long tail at alpha 1: first_ready 40.0 vs in_order 40.4 samples/s; with one group "
         "ahead 218.4, and 339.3 with on_update: continue)",
         (_edit(("    loss: grpo", "    loss: grpo\n    consume: first_ready"),
                ("    model: policy\n    pool: rollout",
                 "    model: policy\n    pool: rollout\n    on_update: finish\n    redundancy: 1.0"),
                at="finish"),),
         severity=_W),
    Code("AF325", "missing-for-kind", "task '{task}' of kind {kind} needs '{key}'{why}",
         (mutate("    engine: hf\n    model: reference\n", "    model: reference\n", at="ref:"),
          mutate("    fn: asyncflow.rewards:digits_match\n", "", at="score:"))),
    Code("AF326", "not-for-kind", "task '{task}' of kind {kind} takes no '{key}'{why}",
         (mutate("    estimator: grpo", "    estimator: grpo\n    model: policy", at="policy\n    inputs: [reward]"),
          mutate("    loss: grpo", "    loss: grpo\n    schedule: queue", at="queue"),
          mutate("    estimator: grpo", "    estimator: grpo\n    refill: true", at="true\n    inputs: [reward]"),
          mutate("    args: {max_new_tokens: 8}", "    args: {max_new_tokens: 8}\n    stream: false",
                 at="false"))),
    # -- AF33x estimators and losses ----------------------------------------------------------
    Code("AF330", "unknown-estimator", "there is no advantage estimator '{name}' (known: {known})",
         (mutate("    estimator: grpo", "    estimator: gpro", at="gpro\n"),)),
    Code("AF331", "unknown-loss", "there is no loss '{name}' (known: {known})",
         (mutate("    loss: grpo", "    loss: ppo2", at="ppo2"),)),
    Code("AF332", "needs-values",
         "estimator '{estimator}' needs the critic's values: list an input produced by a value task",
         (mutate("    estimator: grpo", "    estimator: gae", at="gae"),)),
    Code("AF333", "critic-mismatch", "train task '{task}' uses loss '{loss}' on model '{model}', {problem}",
         (mutate("    loss: grpo", "    loss: value", at="value\n"),)),
    # -- AF34x references and files -----------------------------------------------------------
    Code("AF340", "module-not-found", "cannot find the module '{module}' of {key} '{ref}'",
         (mutate("asyncflow.rewards:digits_match", "asyncflow.reward:digits_match",
                 at="asyncflow.reward:"),)),
    Code("AF341", "no-such-function", "module '{module}' has no top-level '{attr}' (for {key} '{ref}')",
         (mutate("asyncflow.rewards:digits_match", "asyncflow.rewards:no_such_reward_fn",
                 at="asyncflow.rewards:no_such"),)),
    Code("AF342", "file-not-found", "{key} '{path}' does not exist (looked in {where})",
         (mutate("asyncflow.datasets:digits", "no_such_dir/prompts.jsonl", at="no_such_dir"),)),
    Code("AF343", "bad-source",
         "data source '{source}': '{value}' is not a \"module:function\" reference, a .jsonl, "
         ".json or .parquet file, a data set directory, nor a hub data set id org/name",
         (mutate("asyncflow.datasets:digits", "prompts.csv", at="prompts.csv"),)),
    Code("AF344", "bad-init",
         "model '{model}': init '{value}' is neither a \"module:factory\" reference, a path, nor a "
         "model id like org/name",
         (mutate("init: asyncflow.models:tiny_decoder", "init: tiny decoder!", at="tiny decoder!"),)),
    # -- where a model comes from (asyncflow.modelsrc) and its chat template -------------------
    Code("AF345", "hub-model-not-cached",
         "model '{model}': init '{value}' is not a directory (looked in {where}) and, as a hub id, "
         "not in the Hugging Face cache {cache}; HF_HUB_OFFLINE=1 forbids downloading it",
         (mutate("init: asyncflow.models:tiny_decoder", "init: nobody-af345/no-such-model",
                 at="nobody-af345"),)),  # the compiler tests run with HF_HUB_OFFLINE=1
    Code("AF346", "chat-without-template",
         "field '{field}' of data source '{source}' holds chat messages (a list of {{role, "
         "content}}), but the tokenizer of model '{model}' ({path}) has no chat template to render "
         "them with",
         (_edit(("init: asyncflow.models:tiny_decoder\n    args: {layers: 2, hidden: 64}",
                 f'init: "{_FIXTURES / "no_template_model"}"'),
                ("source: asyncflow.datasets:digits\n    args: {n: 100, seed: 0}",
                 f'source: "{_FIXTURES / "chat_prompts.jsonl"}"'), at="prompt, answer]"),)),
    Code("AF339", "model-ships-code",
         "model '{model}': the checkpoint {path} ships code of its own ({classes}), which runs only "
         "with trust_remote_code",
         (mutate("init: asyncflow.models:tiny_decoder\n    args: {layers: 2, hidden: 64}",
                 f'init: "{_FIXTURES / "own_code_model"}"', at='"/'),)),
    Code("AF348", "prompt-loses-characters",
         "field '{field}' of data source '{source}': the tokenizer of model '{model}' ({path}) "
         "cannot encode {chars} of the first row's prompt: the model would read {back} for {text}",
         (_edit(("init: asyncflow.models:tiny_decoder\n    args: {layers: 2, hidden: 64}",
                 f'init: "{_FIXTURES / "narrow_tokenizer_model"}"'),
                ("source: asyncflow.datasets:digits\n    args: {n: 100, seed: 0}",
                 f'source: "{_FIXTURES / "chat_prompts.jsonl"}"'), at="prompt, answer]"),)),
    Code("AF349", "chat-template-rejects-prompt",
         "field '{field}' of data source '{source}': the chat template of model '{model}' ({path}) "
         "refuses the first row's messages: {why}",
         (_edit(("init: asyncflow.models:tiny_decoder\n    args: {layers: 2, hidden: 64}",
                 f'init: "{_FIXTURES / "strict_template_model"}"'),
                ("source: asyncflow.datasets:digits\n    args: {n: 100, seed: 0}",
                 f'source: "{_FIXTURES / "chat_prompts.jsonl"}"'), at="prompt, answer]"),)),
    Code("AF347", "init-is-a-file",
         "model '{model}': init '{value}' is a file ({path}); a model is a directory (a Hugging "
         "Face checkpoint: config.json, weights, tokenizer files), a hub id or a \"module:factory\"",
         (mutate("init: asyncflow.models:tiny_decoder", f'init: "{Path(__file__).resolve()}"',
                 at='"/'),)),
    # -- AF39x data sources: splits and data set directories (AF342/AF343: not found, no source)
    Code("AF390", "bad-split", "data source '{source}': {problem}",
         (mutate("    fields: [prompt, answer]\n", "    fields: [prompt, answer]\n    split: train\n",
                 at="train\n"),)),
    Code("AF392", "data-file-lacks-field",
         "data source '{source}': the rows of {path} have no field '{field}' (they have: {has})",
         (mutate("source: asyncflow.datasets:digits\n    args: {n: 100, seed: 0}",
                 f'source: "{_FIXTURES / "question_gold.jsonl"}"', at="answer]"),)),
    Code("AF391", "not-a-dataset-dir",
         "data source '{source}': directory '{path}' holds no data set: neither one that "
         "save_to_disk wrote (dataset_dict.json or state.json) nor data files (.jsonl, .json, "
         ".parquet, .csv, .arrow, ...) that load_dataset reads",
         (mutate("asyncflow.datasets:digits", ".", at=".\n    args"),)),
    # -- AF35x weight sync --------------------------------------------------------------------
    Code("AF350", "sync-unknown-task", "sync edge: there is no task '{name}'",
         (mutate("{from: update, to: generate", "{from: updte, to: generate", at="updte"),)),
    Code("AF351", "sync-not-from-train",
         "a sync edge starts at the train task that updates the weights; '{task}' is of kind {kind}",
         (mutate("{from: update, to: generate", "{from: score, to: generate", at="score, to"),)),
    Code("AF352", "sync-target", "sync edge to '{dst}': {problem}",
         (mutate("{from: update, to: generate", "{from: update, to: update", at="update, max"),)),
    Code("AF353", "sync-duplicate", "a second sync edge from '{src}' to '{dst}'",
         (mutate("  - {from: update, to: generate, max_staleness: 1}",
                 "  - {from: update, to: generate, max_staleness: 1}\n"
                 "  - {from: update, to: generate, max_staleness: 0}",
                 at="{from: update, to: generate, max_staleness: 0}"),)),
    Code("AF354", "sync-missing",
         "task '{task}' uses model '{model}', which '{trainer}' trains, but no sync edge brings it the "
         "new weights",
         (mutate("  - {from: update, to: generate, max_staleness: 1}", "  []", at="policy\n    pool: rollout"),)),
    Code("AF355", "sync-frozen",
         "sync edge to '{dst}': its model '{model}' is frozen, so there are no weights to sync (and "
         "max_staleness means nothing)",
         (mutate("  - {from: update, to: generate, max_staleness: 1}",
                 "  - {from: update, to: generate, max_staleness: 1}\n  - {from: update, to: ref, max_staleness: 0}",
                 at="ref, max_staleness: 0"),)),
    # -- AF36x batches and args ---------------------------------------------------------------
    Code("AF360", "batch-divisibility",
         "prompts_per_step * samples_per_prompt = {total} is not divisible by {what} of task '{task}'",
         (mutate("micro_batch: 8", "micro_batch: 6", at="6}"),)),
    Code("AF361", "bad-arg", "'args.{key}' of task '{task}' must be {expected}, not {got}",
         (mutate("{max_new_tokens: 8}", "{max_new_tokens: -5}", at="-5"),
          mutate("{lr: 1.0e-4,", "{lr: 0.0,", at="0.0,"))),  # a wrong type: AF211
    Code("AF362", "bad-distribution", "'{key}' of task '{task}': {problem}",
         (mutate("    engine: hf\n    model: policy\n    pool: rollout\n    inputs: [prompt]\n"
                 "    outputs: [response, logprobs]\n    args: {max_new_tokens: 8}",
                 "    engine: sim\n    model: policy\n    pool: rollout\n    inputs: [prompt]\n"
                 "    outputs: [response, logprobs]\n    args: {latency: {dist: lognormal, sigma: 1.0}}",
                 at="{dist: lognormal"),)),
    Code("AF363", "no-train", "the pipeline has no train task: nothing learns",
         (mutate("    kind: train\n    engine: hf\n    model: policy\n    pool: train\n    loss: grpo\n",
                 "    kind: custom\n    fn: asyncflow.rewards:digits_match\n    keep: []\n", at="tasks:"),),
         severity=_W),
    # -- AF37x bindings (the bind pass) --------------------------------------------------------
    Code("AF370", "missing-role",
         "{kind} task '{task}' needs its {role} ({type}), and none of its inputs is one",
         (_edit(("    outputs: [response, logprobs]\n", "    outputs: [response, logprobs]\n    keep: [logprobs]\n"),
                ("[prompt, response, logprobs, ref_logprobs, advantages]",
                 "[prompt, response, ref_logprobs, advantages]"),
                at="[prompt, response, ref_logprobs, advantages]"),)),
    Code("AF371", "ambiguous-role", "inputs '{a}' and '{b}' of task '{task}' could both be its {role} ({type})",
         (mutate("[prompt, response, logprobs, ref_logprobs, advantages]",
                 "[prompt, answer, response, logprobs, ref_logprobs, advantages]",
                 at="answer, response, logprobs"),)),
    Code("AF372", "role-type-mismatch",
         "input {field} of task '{task}' does not fit: a {kind} task needs its {role} as {type}",
         (_edit(("    outputs: [response, logprobs]\n", "    outputs: [response, logprobs]\n    keep: [logprobs]\n"),
                ("[prompt, response, logprobs, ref_logprobs, advantages]",
                 "[prompt, response, reward, ref_logprobs, advantages]"),
                at="reward, ref_logprobs"),)),
    Code("AF373", "unused-input", "input {field} has no place in {kind} task '{task}'",
         (mutate("    inputs: [prompt, response]\n    outputs: [ref_logprobs]",
                 "    inputs: [prompt, response, reward]\n    outputs: [ref_logprobs]",
                 at="reward]\n    outputs: [ref_logprobs]"),)),
    Code("AF374", "fn-arity", "{fn} does not fit the inputs of task '{task}': {problem}",
         (mutate("    inputs: [prompt, answer, response]", "    inputs: [answer, response]",
                 at="[answer, response]"),)),
    Code("AF375", "too-many-outputs",
         "task '{task}' lists {n} outputs, but a {kind} task writes at most {most} ({roles})",
         (mutate("    outputs: [response, logprobs]\n", "    outputs: [response, logprobs, extra]\n    keep: [extra]\n",
                 at="extra]\n    keep"),)),
    Code("AF376", "reserved-field",
         "field '{field}': names that start with '_' are the sample store's own columns "
         "(_row, _group, _version)",
         (_edit(("    outputs: [reward]", "    outputs: [_version]"),
                ("    inputs: [reward]", "    inputs: [_version]"), at="_version]\n  ref"),)),
    # -- AF38x scheduling keys (their kinds: AF326; their values: AF202, AF205, AF206) -----------
    Code("AF380", "on-update-no-effect", "on_update: {value} of rollout '{task}' has no effect: {why}",
         (mutate("    args: {max_new_tokens: 8}",
                 "    args: {max_new_tokens: 8}\n    schedule: batch\n    on_update: abort", at="abort"),
          _edit(("    model: policy\n    pool: rollout",
                 "    model: reference\n    pool: rollout\n    on_update: continue"),
                ("  - {from: update, to: generate, max_staleness: 1}", "  []"), at="continue")),
         severity=_W),
    Code("AF381", "redundancy-ignored", "redundancy {value} of rollout '{task}' is ignored: {why}",
         (_edit(("    model: policy\n    pool: rollout",
                 "    model: reference\n    pool: rollout\n    redundancy: 1.5"),
                ("  - {from: update, to: generate, max_staleness: 1}", "  []"), at="1.5"),),
         severity=_W),
    Code("AF382", "first-ready-in-order",
         "consume: first_ready of train task '{task}' takes what in_order takes: with max_staleness "
         "0, step n may train only samples of version n",
         (_edit(("    loss: grpo", "    loss: grpo\n    consume: first_ready"),
                ("max_staleness: 1", "max_staleness: 0"), at="first_ready"),),
         severity=_W),
    Code("AF383", "nothing-to-stream", "stream: true of train task '{task}' streams nothing: {why}",
         (mutate("{lr: 1.0e-4, micro_batch: 8}", "{lr: 1.0e-4}\n    stream: true", at="true\nsync"),
          mutate("{lr: 1.0e-4, micro_batch: 8}", "{lr: 1.0e-4, micro_batch: 16}\n    stream: true",
                 at="true\nsync")),
         severity=_W),
    # -- AF384-AF389 the eval: section (asyncflow.compiler.passes.evalplan, rules 1-5) ----------
    Code("AF384", "eval-unknown-source", "eval: there is no data source '{source}' (sources: {known})",
         (mutate("sync:\n", "eval: {data: prompt}\nsync:\n", at="prompt}"),)),
    Code("AF385", "eval-rollout", "eval: {problem} (rollout tasks: {known})",
         (mutate("sync:\n", "eval: {data: prompts, rollout: score}\nsync:\n", at="score}"),)),
    Code("AF386", "eval-metric", "eval: {problem}",
         (mutate("sync:\n", "eval: {data: prompts, metric: ref}\nsync:\n", at="ref}"),
          mutate("sync:\n", "eval: {data: prompts, metric: score, fn: asyncflow.rewards:digits_match}"
                 "\nsync:\n", at="asyncflow.rewards:digits_match}"))),
    Code("AF387", "eval-field",
         "eval: {who} reads field '{field}', which the held-out source '{source}' does not have "
         "(it has: {have})",
         (_edit(("    fields: [prompt, answer]\n",
                 "    fields: [prompt, answer]\n  held:\n    source: asyncflow.datasets:digits\n"
                 "    fields: [question, answer]\n"),
                ("sync:\n", "eval: {data: held}\nsync:\n"), at="held}"),
          mutate("sync:\n", "eval: {data: prompts, inputs: [answer, reward, response]}\nsync:\n",
                 at="reward, response]"))),
    Code("AF388", "eval-every-beyond-steps",
         "eval: every {every} is more than the run's {steps} steps: it evaluates at step 0 and at "
         "the end only",
         (mutate("sync:\n", "eval: {data: prompts, every: 5}\nsync:\n", at="5}"),), severity=_W),
    Code("AF389", "eval-sampling-ignored", "eval: '{key}' has no effect with greedy decoding: {why}",
         (mutate("sync:\n", "eval: {data: prompts, temperature: 0.7}\nsync:\n", at="0.7}"),
          mutate("sync:\n", "eval: {data: prompts, samples_per_prompt: 3}\nsync:\n", at="3}")),
         severity=_W),
]

