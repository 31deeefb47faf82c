"""asyncflow vs TRL's GRPOTrainer on CPU: samples/s and time to a reward threshold, side by side.

Both sides train the same model (``asyncflow.models.tiny_decoder(layers=2, hidden=64, seed=0)``, a
randomly initialised Qwen2ForCausalLM), on the same task (``asyncflow.datasets.digits``), with
the same reward (``asyncflow.rewards.digits_match``) and the same number of completions per step
(``--prompts-per-step`` x 8), learning rate 1e-3, temperature 1.0, at most 8 new tokens, a KL
penalty of 0.001 to a frozen reference, clipping 0.2, gradient clipping 1.0, constant LR:

- asyncflow: ``pipelines/grpo_digits.yaml`` through the real CLI (``asyncflow run ... --out DIR``,
  a subprocess), read back from ``DIR/metrics.jsonl``. ``--set`` overrides make it use the common
  setting (prompts per step, steps, staleness ``--alpha``, default the file's 1).
- TRL: ``GRPOTrainer`` (``use_cpu``, no vLLM, fp32, ``loss_type="grpo"``, ``scale_rewards="group"``,
  ``beta=0.001``), one optimiser step per generation batch, in a subprocess of this script; per-step
  wall time and mean reward come from a ``TrainerCallback``. The tokenizer is a
  ``PreTrainedTokenizerFast`` whose ids are exactly those of asyncflow's ``CharTokenizer`` (same
  pad/bos/eos; ``<bos>`` prepended; no chat template, so the plain-text prompts are used as-is).

TRL uses ``torch.set_num_threads(--threads)`` (default 2: the whole machine, one process);
asyncflow splits the same 2 cores by its own rule (one torch thread per CPU slot: the rollout
pool's core, the train pool's core), unless ``--af-threads`` forces a count. Reported, for each side:
steady-state samples/s (completions per second over steps 2..N: step 1 is warm-up), the train
time (from the start of step 1) until the mean reward over a ``--window``-step window first
reaches ``--threshold``, and the ratios asyncflow/TRL.

    .venv/bin/python benchmarks/vs_trl.py                     # default: 16 x 16, 200 steps
    .venv/bin/python benchmarks/vs_trl.py --steps 2 --prompts-per-step 4   # smoke

TRL is not a dependency of asyncflow: without it the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = os.path.join(ROOT, "pipelines", "grpo_digits.yaml")
SAMPLES_PER_PROMPT = 16
MAX_NEW_TOKENS = 8
LR = 1e-3
KL_COEF = 0.001

# What runs the asyncflow CLI. transformers' lazy module is not thread-safe on first import:
# worker threads of `--backend local` that import it at once can fail with "cannot import name
# 'Qwen2Config'", so the model classes are imported once, on the main thread, before the CLI
# (asyncflow.cli:main, the `asyncflow` console script) starts.
_AF_LAUNCHER = (
    "import sys\n"
    "from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: F401\n"
    "from asyncflow.cli import main\n"
    "sys.argv = ['asyncflow'] + sys.argv[1:]\n"
    "main()\n"
)


# ---------------------------------------------------------------------------- metrics


def steady_samples_per_s(steps: list[dict]) -> float | None:
    """Completions per second over steps 2..N (step 1 is warm-up); None with < 2 steps."""
    rest = steps[1:]
    t = sum(s["step_time"] for s in rest)
    return sum(s["samples"] for s in rest) / t if rest and t > 0 else None


def median_samples_per_s(steps: list[dict]) -> float | None:
    """Completions per step / the median step time of steps 2..N: robust to the odd step slowed
    by another process on a shared machine."""
    rest = sorted(s["step_time"] for s in steps[1:])
    if not rest:
        return None
    m = len(rest) // 2
    med = rest[m] if len(rest) % 2 else (rest[m - 1] + rest[m]) / 2
    return steps[1]["samples"] / med if med > 0 else None


def time_to_threshold(steps: list[dict], threshold: float, window: int):
    """(train seconds from the start of step 1, step number) at the end of the first
    ``window``-step window whose mean reward is >= ``threshold``; (None, None) if never."""
    elapsed = 0.0
    rewards: list[float] = []
    for i, s in enumerate(steps):
        elapsed += s["step_time"]
        rewards.append(s["reward_mean"])
        if len(rewards) >= window and sum(rewards[-window:]) / window >= threshold:
            return elapsed, i + 1
    return None, None


# ---------------------------------------------------------------------------- asyncflow


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (``/proc/stat``: all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _label(pid: int) -> str:
    """What a process is, for the per-process table: its command line's program, or, for a Ray
    process (which sets its title: ``ray::UpdateWorker.loop``, ``ray::IDLE``), that title."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    prog = os.path.basename(argv[0])
    if prog.startswith("python") and len(argv) > 1:
        rest = [a for a in argv[1:] if not a.startswith("-")]
        mod = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-m", "-c")), "")
        if mod.startswith("import sys") or mod == "asyncflow.cli":  # the asyncflow CLI
            return "asyncflow run (driver)"
        return f"python {os.path.basename(mod or (rest[0] if rest else ''))}"[:60]
    return prog[:60]


def _tree_cpu_s(root: int, seen: dict[int, float], names: dict[int, str] | None = None) -> None:
    """Record in ``seen`` (pid -> CPU s) the user + system time of ``root`` and every process
    under it now (``/proc``): a Ray run's workers are the raylet's children, its own child;
    ``names``: each one's :func:`_label` (read again while it lives: Ray retitles workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    stat: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile: its last reading stays in seen
            continue
        parent[int(d)] = int(fields[1])
        stat[int(d)] = (int(fields[11]) + int(fields[12])) / tick
    mine, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in mine:
                mine.add(c)
                frontier.append(c)
    for pid in mine:
        if pid in stat:
            seen[pid] = max(seen.get(pid, 0.0), stat[pid])
            if names is not None:  # a worker's last title other than IDLE is kept
                label = _label(pid)
                if label != "?" and (names.get(pid, "?") == "?" or label != "ray::IDLE"):
                    names[pid] = label


def _run_child(cmd, env=None, by_process: dict | None = None):
    """(CompletedProcess, wall s, CPU s used while it ran, CPU s of its own processes);
    ``by_process``, if given, is filled with CPU s by process label (:func:`_label`). The
    first CPU figure is the machine's busy time (``/proc/stat``), not the child's rusage: a Ray
    run's worker processes are children of the raylet, which a child's rusage never counts; on a
    quiet machine the rest is noise. Without ``/proc/stat``, the child's own rusage (its children
    included). The second sums the CPU time of the child and every process under it, read from
    ``/proc`` every 0.2 s (a process's last reading counts: at most 0.2 s of each is missed),
    so other work on a shared machine does not count; None without ``/proc``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = _busy_cpu_s()
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    seen: dict[int, float] = {}
    names: dict[int, str] | None = {} if by_process is not None else None
    tree = os.path.isdir("/proc/self")
    out, err = "", ""
    while True:
        if tree:
            _tree_cpu_s(child.pid, seen, names)
        try:
            out, err = child.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            continue
    proc = subprocess.CompletedProcess(cmd, child.returncode, out, err)
    wall = time.perf_counter() - t0
    busy1 = _busy_cpu_s()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tree_s = max(sum(seen.values()), own) if tree else None
    if names is not None:  # by_process was given
        for pid, cpu in seen.items():
            label = names.get(pid, "?")
            by_process[label] = by_process.get(label, 0.0) + cpu
    if busy0 is not None and busy1 is not None:
        return proc, wall, busy1 - busy0, tree_s
    return proc, wall, own, tree_s


def run_asyncflow(a, work: str) -> dict:
    out_dir = os.path.join(work, "asyncflow_run")
    sets = [f"models.policy.args.layers={a.layers}", f"models.policy.args.hidden={a.hidden}",
            f"step.prompts_per_step={a.prompts_per_step}",
            f"step.samples_per_prompt={SAMPLES_PER_PROMPT}",
            f"step.steps={a.steps}",
            f"tasks.generate.args.max_new_tokens={MAX_NEW_TOKENS}",
            f"tasks.update.args.lr={LR}",
            f"tasks.update.args.kl_coef={KL_COEF}"]
    if a.af_threads:  # default: asyncflow's own rule (an engine takes its replica's CPU slots)
        sets += [f"tasks.{t}.args.threads={a.af_threads}" for t in ("generate", "ref", "update")]
    micro = a.micro_batch or a.prompts_per_step * SAMPLES_PER_PROMPT
    sets += [f"tasks.update.args.micro_batch={micro}", f"tasks.ref.args.micro_batch={micro}"]
    if a.alpha is not None:
        sets.append(f"sync.0.max_staleness={a.alpha}")
    sets += list(a.af_set or [])  # last: they win
    # the local backend's threads need the model classes imported first (_AF_LAUNCHER); on Ray
    # the driver runs no model, and the plain CLI is what a user runs (the launcher's import of
    # transformers cost the driver ~3.5 CPU s, 40% of its CPU in a 100-step run)
    launch = ["-c", _AF_LAUNCHER] if a.backend == "local" else ["-m", "asyncflow.cli"]
    cmd = [sys.executable, *launch, "run", PIPELINE, "--backend", a.backend,
           "--out", out_dir, "--steps", str(a.steps), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    print(f"[asyncflow] {' '.join(cmd[1 + len(launch):])}", flush=True)
    by_process: dict[str, float] = {}
    proc, wall, cpu, tree = _run_child(cmd, by_process=by_process)
    path = os.path.join(out_dir, "metrics.jsonl")
    if proc.returncode != 0 or not os.path.exists(path):
        return {"error": f"asyncflow run exited {proc.returncode}: "
                         f"{(proc.stderr or proc.stdout).strip()[-2000:]}"}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [{"step_time": float(r["step_time"]), "samples": int(r["samples"]),
              "reward_mean": float(r["reward_mean"])} for r in rows]
    return {"steps": steps, "wall_s": wall, "cpu_s": cpu, "tree_cpu_s": tree,
            "by_process": by_process}


# ---------------------------------------------------------------------------- TRL


def char_tokenizer_fast():
    """A transformers tokenizer with exactly the ids of asyncflow's CharTokenizer: one token per
    character (a BPE model with no merges), ``<bos>`` prepended, special tokens dropped on
    decode."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from asyncflow.models import CharTokenizer

    ct = CharTokenizer()
    vocab = {tok: i for i, tok in enumerate(ct.SPECIALS)}
    vocab.update(ct._to_id)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", ct.bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>", padding_side="left")
    for text in (ct.CHARS, "3+4=", "copy 417="):  # the ids must be asyncflow's, exactly
        want = [ct.bos_id] + ct.encode(text)
        got = tok(text)["input_ids"]
        assert got == want, f"tokenizer mismatch on {text!r}: {got} != {want}"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (ct.pad_id, ct.bos_id, ct.eos_id)
    assert tok.decode([ct.bos_id] + ct.encode("12+3") + [ct.eos_id], skip_special_tokens=True) == "12+3"
    return tok


def trl_worker(a, out_path: str) -> None:
    """Runs in a child process: GRPOTrainer for ``a.steps`` steps; one JSON line per step."""
    import logging
    import warnings

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncflow.datasets import digits
    from asyncflow.models import tiny_decoder
    from asyncflow.rewards import digits_match

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(a.threads)
    n_completions = a.prompts_per_step * SAMPLES_PER_PROMPT
    micro = a.micro_batch or n_completions
    if n_completions % micro:
        raise SystemExit(f"--micro-batch {micro} must divide {n_completions}")
    accum = n_completions // micro

    tok = char_tokenizer_fast()
    # TRL builds its reference model (beta > 0) from the policy's name or path, so the policy is
    # handed over as a local directory holding tiny_decoder's seed-0 weights (nothing downloaded)
    model_dir = os.path.join(os.path.dirname(out_path), "tiny_decoder")
    tiny_decoder(layers=a.layers, hidden=a.hidden, seed=0).model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = digits(n=max(a.steps * a.prompts_per_step, 64), seed=0)
    dataset = Dataset.from_list(rows)

    def digits_reward(prompts, completions, answer, **kw):
        return [digits_match(p, ans, c) for p, ans, c in zip(prompts, answer, completions)]

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out_path), "trl_out"),
        use_cpu=True, use_vllm=False, bf16=False, fp16=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        steps_per_generation=accum,  # one generation batch of n_completions per optimiser step
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=KL_COEF, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=a.steps,
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,  # TRL turns it on by default; a 0.2M model needs no saving
    )

    class StepClock(TrainerCallback):
        def __init__(self):
            self.last = None
            self.f = open(out_path, "w")

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.pending = {"step": state.global_step, "step_time": now - self.last,
                            "samples": n_completions}
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and getattr(self, "pending", None):
                self.pending["reward_mean"] = float(logs["reward"])
                self.f.write(json.dumps(self.pending) + "\n")
                self.f.flush()
                self.pending = None

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[digits_reward], args=config,
                          train_dataset=dataset, processing_class=tok, callbacks=[StepClock()])
    trainer.train()


def run_trl(a, work: str) -> dict:
    out_path = os.path.join(work, "trl_steps.jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "--_trl-worker", out_path,
           "--steps", str(a.steps), "--prompts-per-step", str(a.prompts_per_step),
           "--threads", str(a.threads), "--layers", str(a.layers), "--hidden", str(a.hidden)]
    if a.micro_batch:
        cmd += ["--micro-batch", str(a.micro_batch)]
    print(f"[trl] GRPOTrainer, {a.steps} steps x {a.prompts_per_step * SAMPLES_PER_PROMPT} "
          "completions", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc, wall, cpu, tree = _run_child(cmd, env)
    steps = []
    if os.path.exists(out_path):
        with open(out_path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    if proc.returncode != 0 or len(steps) < a.steps:
        return {"error": f"TRL run exited {proc.returncode} after {len(steps)} steps: "
                         f"{(proc.stderr or proc.stdout).strip()[-2000:]}"}
    return {"steps": steps, "wall_s": wall, "cpu_s": cpu, "tree_cpu_s": tree}


# ---------------------------------------------------------------------------- report


def summarise(res: dict, a) -> dict:
    if "steps" not in res:
        return res
    steps = res["steps"]
    ttt, at_step = time_to_threshold(steps, a.threshold, a.window)
    samples = sum(s.get("samples") or a.prompts_per_step * SAMPLES_PER_PROMPT for s in steps)
    tail = steps[-a.window:]
    return {**res, "samples_per_s": steady_samples_per_s(steps),
            "median_samples_per_s": median_samples_per_s(steps),
            "step_s": (sum(s["step_time"] for s in steps[1:]) / (len(steps) - 1)
                       if len(steps) > 1 else None),
            "time_to_threshold_s": ttt, "threshold_step": at_step,
            "final_reward": sum(s["reward_mean"] for s in tail) / len(tail),
            "train_s": sum(s["step_time"] for s in steps),
            # CPU s per 1,000 samples: the run's own processes (whole run, startup included)
            "cpu_per_1k": (res["tree_cpu_s"] / samples * 1000
                           if res.get("tree_cpu_s") is not None and samples else None)}


def print_by_process(by_process: dict[str, float], total: float | None) -> None:
    """asyncflow's CPU seconds by process (Ray's daemons, its workers by title, the driver):
    where the CPU that is not the engines' compute goes."""
    total = total or sum(by_process.values()) or 1.0
    print("\nasyncflow's CPU by process (s, share of its processes' total):")
    for label, cpu in sorted(by_process.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.05:
            print(f"  {label:<44} {cpu:8.1f}  {cpu / total:6.1%}")


def _f(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_table(af: dict | None, trl: dict | None, a) -> None:
    def cell(r, key, spec=".1f"):
        if r is None:
            return "skipped"
        if "error" in r:
            return "failed"
        return _f(r.get(key), spec)

    def ttt(r):
        if r is None:
            return "skipped"
        if "error" in r:
            return "failed"
        if r["time_to_threshold_s"] is None:
            return "not reached"
        return f"{r['time_to_threshold_s']:.1f} (step {r['threshold_step']})"

    def ratio(key, invert=False):
        if not (af and trl and "error" not in af and "error" not in trl):
            return "-"
        x, y = af.get(key), trl.get(key)
        if x is None or y is None or x <= 0 or y <= 0:
            return "-"
        return f"{(y / x if invert else x / y):.2f}x"

    n = a.prompts_per_step * SAMPLES_PER_PROMPT
    title = (f"asyncflow vs TRL GRPOTrainer, CPU, tiny_decoder(layers={a.layers}, "
             f"hidden={a.hidden}): "
             f"{a.prompts_per_step} prompts x {SAMPLES_PER_PROMPT} = {n} completions/step, "
             f"{a.steps} steps, threshold: mean reward >= {a.threshold} over {a.window} steps")
    rows = [
        ("samples/s (steady, steps 2..N)", cell(af, "samples_per_s"), cell(trl, "samples_per_s"),
         ratio("samples_per_s")),
        ("samples/s (median step, 2..N)", cell(af, "median_samples_per_s"),
         cell(trl, "median_samples_per_s"), ratio("median_samples_per_s")),
        ("s/step (steady)", cell(af, "step_s", ".3f"), cell(trl, "step_s", ".3f"),
         ratio("step_s", invert=True)),
        ("time to threshold (train s)", ttt(af), ttt(trl), ratio("time_to_threshold_s", invert=True)),
        (f"reward, last {a.window} steps", cell(af, "final_reward", ".3f"),
         cell(trl, "final_reward", ".3f"), "-"),
        ("train time, all steps (s)", cell(af, "train_s"), cell(trl, "train_s"), "-"),
        ("process wall incl. startup (s)", cell(af, "wall_s"), cell(trl, "wall_s"),
         ratio("wall_s", invert=True)),
        ("machine CPU time while it ran (s)", cell(af, "cpu_s"), cell(trl, "cpu_s"),
         ratio("cpu_s", invert=True)),
        ("CPU s per 1,000 samples (own processes)", cell(af, "cpu_per_1k", ".2f"),
         cell(trl, "cpu_per_1k", ".2f"), ratio("cpu_per_1k", invert=True)),
    ]
    heads = ("metric", "asyncflow", "TRL", "asyncflow/TRL")
    widths = [max(len(str(r[i])) for r in rows + [heads]) for i in range(4)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    print()
    print(title)
    print(line)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |")
    print(line)
    for r in rows:
        print("| " + r[0].ljust(widths[0]) + " | "
              + " | ".join(str(c).rjust(w) for c, w in zip(r[1:], widths[1:])) + " |")
    print(line)
    print("ratios: samples/s asyncflow/TRL (higher is better for asyncflow); s/step and time to "
          "threshold as TRL/asyncflow (speed-up).")
    for name, r in (("asyncflow", af), ("TRL", trl)):
        if r and "error" in r:
            print(f"{name} failed: {r['error']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="train steps for each side (default 200)")
    p.add_argument("--prompts-per-step", type=int, default=16,
                   help="prompts per step; x8 completions each (default 32 -> 256)")
    p.add_argument("--threshold", type=float, default=0.3, help="mean reward to reach (default 0.3)")
    p.add_argument("--window", type=int, default=5, help="steps in the reward window (default 5)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--skip-asyncflow", action="store_true")
    p.add_argument("--backend", default="local", choices=("local", "ray"),
                   help="asyncflow backend (default local: threads)")
    p.add_argument("--alpha", type=int, default=None,
                   help="asyncflow max_staleness (default: the pipeline file's, 1)")
    p.add_argument("--layers", type=int, default=2, help="tiny_decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="tiny_decoder hidden size (default 64)")
    p.add_argument("--threads", type=int, default=2,
                   help="TRL's torch threads (default 2: the whole machine)")
    p.add_argument("--af-threads", type=int, default=0,
                   help="force asyncflow's engines to this many torch threads each (default: "
                        "asyncflow's rule, one per CPU slot of the replica: the 2 cores split "
                        "between the rollout pool and the train pool)")
    p.add_argument("--af-set", action="append", metavar="KEY.PATH=VALUE",
                   help="one more --set for asyncflow's run (repeatable), e.g. "
                        "tasks.update.args.threads=2")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per forward/backward pass, both sides: asyncflow's update/ref "
                        "micro_batch and TRL's per_device_train_batch_size (with gradient "
                        "accumulation to one optimiser step per generation batch). Default: "
                        "all completions of a step (one pass), for both")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--_trl-worker", dest="trl_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.trl_worker:
        trl_worker(a, a.trl_worker)
        return 0

    trl_version = None
    if not a.skip_trl:
        try:
            import trl  # noqa: F401
            trl_version = trl.__version__
        except ImportError:
            print("vs_trl: TRL is not installed (it is not an asyncflow dependency); "
                  "`pip install trl` to run this comparison. Nothing to do.")
            return 0
    try:
        import torch
        import transformers
    except ImportError:
        print("vs_trl: needs torch and transformers (pip install 'asyncflow[hf]'). Nothing to do.")
        return 0
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl_version or '-'}, {os.cpu_count()} CPUs, torch threads {a.threads}, "
          f"asyncflow backend {a.backend}", flush=True)

    af = trl = None
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as work:
        if not a.skip_asyncflow:
            af = summarise(run_asyncflow(a, work), a)
        if not a.skip_trl:
            trl = summarise(run_trl(a, work), a)
    print_table(af, trl, a)
    if af and af.get("by_process"):
        print_by_process(af["by_process"], af.get("tree_cpu_s"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "trl_worker"},
                       "trl_version": trl_version, "torch": torch.__version__,
                       "asyncflow": af, "trl": trl}, f, indent=1)
    return 1 if any(r and "error" in r for r in (af, trl)) else 0


if __name__ == "__main__":
    sys.exit(main())
