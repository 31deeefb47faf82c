"""AF6xx: user errors found when a plan runs (data that cannot be read, a bad resume directory,
a user function that raises, an output that does not fit its role's type)."""
from asyncflow.diagnostics.code import Code

CODES = [
    Code("AF601", "data-unreadable", "data source '{name}' ({source}) cannot be read: {reason}"),
    Code("AF602", "data-empty", "data source '{name}' ({source}) gave no rows"),
    Code("AF603", "data-fields", "data source '{name}' ({source}): row {row} has no field '{field}'"),
    Code("AF605", "data-null", "data source '{name}' ({source}): field '{field}' is null in row {row}"),
    Code("AF606", "data-too-few",
         "data source '{name}' ({source}) has {rows:,} prompts: epochs {epochs} give "
         "{have:,}, but {steps} steps x {pps} prompts need {need:,} (epochs >= {passes})"),
    Code("AF607", "data-split", "data source '{name}' ({source}): {problem}"),
    Code("AF609", "cluster-too-small",
         "the pools need {need:g} {resource} in all, and pool '{pool}' is where {where} "
         "{have:g} run out"),
    Code("AF608", "cluster-unreachable",
         "cannot join the Ray cluster at {address}: {why}"),
    Code("AF613", "ray-start-failed",
         "a local Ray did not start ({attempts} attempts): {why}"),
    Code("AF604", "cluster-lacks-resources",
         "pool '{pool}' needs {need:g} {resource} in one bundle but no node of the Ray cluster has "
         "that much (the largest has {have:g}; the cluster: {cluster})"),
    # raised by workers (asyncflow.runtime.contract), located at the task's definition
    Code("AF610", "task-raised", "task '{task}': {fn} raised {error} (row {row})"),
    Code("AF611", "task-output-missing", "task '{task}': output '{field}' {problem} (row {row})"),
    Code("AF612", "task-output-type", "task '{task}': output '{field}' holds {problem} (row {row})"),
    # the run directory (asyncflow.runtime.rundir)
    Code("AF620", "resume-nothing", "--resume {run_dir}: nothing to resume: {why}"),
    Code("AF621", "resume-plan-changed",
         "--resume: the plan differs from the one {ck} was made with, in {n} place(s): {diffs} "
         "(resume with --force to run the new plan from that checkpoint anyway)"),
    Code("AF622", "run-dir-not-empty",
         "--out {run_dir} already holds a run ({files}): --resume it, pick another --out, or "
         "--force to replace it"),
    Code("AF623", "run-dir-locked", "{run_dir} is in use by another asyncflow run (pid {pid})"),
    Code("AF624", "run-dir-foreign-files",
         "--out {run_dir} holds {files}, which no asyncflow run there wrote (its "
         ".asyncflow-manifest.json does not list them): --force removes only what asyncflow "
         "wrote; move them away or pick another --out"),
    # run-time faults (asyncflow.runtime.driver: the watchdog, worker deaths, lost actors)
    Code("AF630", "run-stalled",
         "the run made no progress for {seconds:g} s (--stall-timeout): worker {worker} (task "
         "'{task}') has been in {op} for {op_s:.1f} s{more}"),
    Code("AF631", "worker-died",
         "worker {worker} (task '{task}') died {times} time(s), more than --max-restarts "
         "{max_restarts} allows: {cause}"),
    Code("AF632", "actor-lost", "the run lost its {what}: {cause}"),
    Code("AF633", "trainer-died",
         "train worker {worker} (task '{task}') died ({cause}) and the run has no checkpoint to "
         "restart it from (run with --checkpoint-every K)"),
    Code("AF634", "bad-inject", "--inject {spec}: {part} {why}"),
    # asyncflow run --log (asyncflow.runtime.loggers), before any worker starts
    Code("AF670", "logger-not-installed",
         "--log {name}: the {module} library is not installed (it is the optional extra "
         "asyncflow[{extra}])"),
    Code("AF671", "logger-unknown", "--log {name}: no such logger (the loggers: {known})"),
    Code("AF672", "logger-failed-to-start", "--log {name}: the logger could not start: {error}"),
    # asyncflow simulate (asyncflow.simulate)
    Code("AF640", "simulate-no-cost",
         "nothing in pipeline '{pipeline}' takes time: no task has a cost hint (engine: sim "
         "args, or a cost: mapping), so every step would take 0 s; give rollout '{task}' one, "
         "e.g. cost: {{latency: 0.05, slots: 32}}, and the trainer cost: {{seconds_per_sample: "
         "0.005}}"),
    Code("AF641", "simulate-stalled",
         "the simulated run stopped after {done} of {steps} steps: {why}"),
    Code("AF642", "bad-sweep", "{what}"),
    Code("AF643", "calibrate-no-trace",
         "--calibrate {run_dir}: {what}: a run directory of `asyncflow run` has plan.json, "
         "metrics.jsonl and trace.json (a run of a few steps is enough)"),
    Code("AF644", "calibrate-other-pipeline",
         "--calibrate {run_dir}: the run is of {other}, not of this pipeline '{pipeline}': "
         "{what}"),
    # asyncflow export (asyncflow.commands.export, asyncflow.runtime.export)
    # a model and its prompts, at start-up and as a rollout encodes them (asyncflow.models)
    Code("AF650", "model-unavailable", "model '{model}': cannot load init '{init}': {reason}"),
    Code("AF651", "chat-without-template-run",
         "task '{task}': a prompt is a list of chat messages, but the tokenizer of model "
         "'{model}', {tokenizer}, has no chat template to render them with"),
    Code("AF652", "bad-prompt",
         "task '{task}': a prompt must be a string or a list of {{role, content}} messages, "
         "not {got}"),
    Code("AF655", "prompt-loses-characters-run",
         "task '{task}': the tokenizer of model '{model}' cannot encode {chars} of the data's "
         "first prompt: the model would read {back} for {text}; train the tokenizer on those "
         "characters (a byte-level BPE: initial_alphabet=pre_tokenizers.ByteLevel.alphabet()) "
         "or keep them out of the data and the chat template"),
    Code("AF656", "chat-template-rejects-prompt-run",
         "task '{task}': the chat template of model '{model}' cannot render a prompt: {reason} "
         "(prompt: {got})"),
    Code("AF657", "prompt-too-long",
         "task '{task}': a prompt of {n} tokens is longer than the {limit} a prompt may have "
         "({why}): shorten the data, lower max_new_tokens, or set args: {{prompt_overflow: "
         "left}} to keep its last tokens (prompt: {got})"),
    Code("AF658", "token-beyond-embeddings",
         "task '{task}': a prompt holds token id {id} ({token}), but the embedding of model "
         "'{model}' has {rows} rows: tokens were added to the tokenizer and the model never "
         "resized (model.resize_token_embeddings(len(tokenizer)), then save it) (prompt: {got})"),
    Code("AF653", "lora-unusable",
         "model '{model}': its LoRA adapter cannot be put on the model: {reason} (the model's "
         "linear layers: {linear})"),
    Code("AF654", "vllm-tensor-parallel",
         "task '{task}': tensor parallelism over {tp} devices (devices_per_replica) cannot run "
         "here: {why}"),
    Code("AF660", "export-not-a-run", "{run_dir} is not a run directory: {why}"),
    Code("AF661", "export-no-step", "{run_dir}: {what}; {have}"),
    Code("AF662", "export-unreadable", "{run_dir}: {what} cannot be exported: {why}"),
    Code("AF663", "export-dir-exists",
         "{out} already exists and is not empty: pick another -o DIR, or --force to replace it"),
    Code("AF664", "export-nothing", "{run_dir}: nothing to export: {why}"),
    Code("AF636", "rendezvous-timeout",
         "task '{task}': replica {replica} waited {waited} s for replica 0 to open the "
         "data-parallel group (its address and port) and it never did"),
    Code("AF638", "weight-sync-peer-lost",
         "worker {task} could not receive model '{model}' through its collective edge from the "
         "trainer at {at} for {waited} s ({error}): the trainer's process is gone or unreachable "
         "from this node (check that the nodes reach each other on any port), or set via: store "
         "on the sync edge"),
    Code("AF637", "distributed-needs-processes",
         "task '{task}': engine {engine} trains its {replicas} replicas as one torch.distributed "
         "group, a process each, but the local backend runs every worker as a thread of one "
         "process: run it on Ray (--backend ray, the default), or with replicas: 1"),
    Code("AF635", "refill-starved",
         "filter {tasks} dropped {groups} groups since the last train step, more than {rounds} "
         "steps' launches: with refill: true new prompts would be fed for ever; check the filter "
         "against the rewards it sees, or set refill: false"),
]
