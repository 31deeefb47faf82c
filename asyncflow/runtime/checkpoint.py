"""Periodic checkpoints and ``asyncflow run FILE --resume RUN_DIR``.

Layout (every ``K`` train steps, ``--checkpoint-every K``; off by default)::

    RUN_DIR/checkpoints/step_N/          N = train steps done = policy version
        engines/<train task>/            the trainer engine's ``save`` (model + optimizer + RNG)
        state.json                       version N, data cursor, steps, plan step settings
        metrics.jsonl, train_rows.jsonl  the run's records of steps 0 .. N-1
        store.json                       rows past the checkpoint some rollout had generated
        plan.json                        the plan the run executed (resume compares it)

``--keep-checkpoints K`` keeps only the newest K complete checkpoints (:func:`prune`, after
each new one is complete). A checkpoint's ``engines/<task>_0`` is itself a Hugging Face directory
(``config.json``, safetensors, tokenizer; a critic's ``value_head.safetensors``) beside the
optimizer state: ``asyncflow export RUN_DIR --step N`` writes a clean copy of it in the model's
dtype (:mod:`asyncflow.runtime.export`).

No file of a checkpoint is a pickle (engines save tensors with ``torch.save`` read back with
``weights_only=True``, or safetensors); every file is fsynced before the rename.

A checkpoint is written into ``checkpoints/.tmp-step_N`` (the trainer saves its engine there
right after train step ``N - 1``, before it starts step ``N``; the driver adds the rest once
every trainer has reported step ``N - 1``) and becomes ``step_N`` by one ``os.rename``, after
``state.json`` -- the completeness marker -- is written and fsynced. A kill at any moment leaves
either a complete ``step_N`` or a ``.tmp-`` directory that resume deletes. Resume takes the
newest checkpoint that reads back whole (:func:`latest`); an unreadable one is skipped, and
said so, for the one before it.

Resume semantics (DESIGN.md, "Exactly once"): **in-flight rollouts are regenerated and
counted**, not restored. Resuming from ``step_N``:

- the trainer loads its engine from the checkpoint (version ``N``, optimizer state) and
  publishes version ``N`` before training, so rollouts start from exactly those weights;
- the data cursor is ``N * prompts_per_step``: the store starts empty, numbering rows from
  ``N * samples_per_step``, and is fed steps ``N, N+1, ...`` again -- so every row of steps
  ``< N`` was trained exactly once (before the checkpoint) and every row of steps ``>= N`` is
  generated and trained exactly once by the resumed run;
- work done after the checkpoint by the killed run (rollouts of later steps, and train steps
  ``>= N`` whose weights the checkpoint does not hold) is discarded: ``RUN_DIR/resume.jsonl``
  records how much (``discarded_steps``: train steps recorded after the checkpoint;
  ``regenerated_rows``: rows of steps ``>= N`` a rollout had already generated when the
  checkpoint closed -- a lower bound, the killed run may have generated more before it died);
- ``metrics.jsonl`` and ``train_rows.jsonl`` are rewritten to the checkpoint's copy (steps
  ``< N``) and continued, so each step appears once.

Not restored: a rollout's sampling RNG (the resumed run samples other responses than an
uninterrupted one would) and the frozen models (rebuilt from their ``init``). ``train_rows.jsonl``
holds one line per (train step, train task): ``{"step", "task", "rows"}``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

CKPT_DIR = "checkpoints"
TMP_PREFIX = ".tmp-step_"
DEL_PREFIX = ".del-"  # a checkpoint being deleted by prune
STATE_FILE = "state.json"
TRAIN_ROWS = "train_rows.jsonl"
RESUME_LOG = "resume.jsonl"
_STEP = re.compile(r"^step_(\d+)$")


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` (in ``checkpoints/``) is a checkpoint, complete or in the making or
    being deleted: one asyncflow wrote."""
    return bool(_STEP.match(name)) or name.startswith((TMP_PREFIX, DEL_PREFIX))


def root(run_dir: str) -> str:
    return os.path.join(run_dir, CKPT_DIR)


def tmp_dir(run_dir: str, version: int) -> str:
    return os.path.join(root(run_dir), f"{TMP_PREFIX}{int(version)}")


def engine_dir(ckpt: str, task: str) -> str:
    return os.path.join(ckpt, "engines", task.replace("/", "_"))


def wanted(every: int | None, version: int, steps: int) -> bool:
    """Is a checkpoint due after the train step that produced ``version``? (Not after the last
    step: the run is over.)"""
    return bool(every) and version % int(every) == 0 and version < steps


# ------------------------------------------------------------------ trainer side (worker)
def save_engine(engine, run_dir: str, version: int, task: str) -> str:
    """The trainer's part: ``engine.save`` into the open checkpoint of ``version``."""
    d = engine_dir(tmp_dir(run_dir, version), task)
    if os.path.exists(d):
        shutil.rmtree(d)
    engine.save(d)
    return d


# ------------------------------------------------------------------ driver side
def close(run_dir: str, version: int, *, steps: int, fed: int, prompts_per_step: int,
          samples_per_step: int, metrics: list[dict], train_rows: list[dict], store,
          first_row: int | None = None) -> str:
    """The driver's part: add state, records and the store snapshot, then rename atomically.
    ``first_row``: where a resumed run numbers its rows from (the trainer's next window with the
    scheduling keys; default ``version * samples_per_step``)."""
    if first_row is None:
        first_row = int(version) * int(samples_per_step)
    tmp = tmp_dir(run_dir, version)
    os.makedirs(tmp, exist_ok=True)
    try:
        past = _generated_past(store.snapshot(), int(first_row))
    except Exception as e:  # the checkpoint does not depend on it (rollouts are regenerated)
        past = {"error": repr(e)}
    _write_json(os.path.join(tmp, "store.json"), past)
    plan_file = os.path.join(run_dir, "plan.json")
    if os.path.exists(plan_file):
        shutil.copyfile(plan_file, os.path.join(tmp, "plan.json"))
    _write_jsonl(os.path.join(tmp, "metrics.jsonl"), [m for m in metrics if m["step"] < version])
    _write_jsonl(os.path.join(tmp, TRAIN_ROWS), [r for r in train_rows if r["step"] < version])
    state = {"version": int(version), "steps_done": int(version), "steps": int(steps),
             "cursor_prompt": int(version) * int(prompts_per_step),
             "first_row": int(first_row), "fed_steps": int(fed),
             "time": time.time()}
    _write_json(os.path.join(tmp, STATE_FILE), state)
    fsync_tree(tmp)
    final = os.path.join(root(run_dir), f"step_{int(version)}")
    if os.path.exists(final):  # a resumed run passing the same step again
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root(run_dir))
    return final


def _generated_past(snap: dict, first: int) -> dict:
    """How many rows at or past ``first`` a rollout had generated (they carry ``_version``)."""
    n = 0
    for part in snap.get("shards") or [snap]:
        n += sum(1 for r, v in zip(part.get("rows", ()), part.get("versions", ()))
                 if r >= first and v is not None)
    return {"first_row": first, "generated_rows_past": n}


def problem(ck: str) -> str | None:
    """Why checkpoint directory ``ck`` cannot be resumed from (None when it reads back whole)."""
    m = _STEP.match(os.path.basename(ck))
    try:
        with open(os.path.join(ck, STATE_FILE)) as f:
            state = json.load(f)
        if not m or int(state["version"]) != int(m.group(1)):
            return "its state.json names another step"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"state.json unreadable ({e.__class__.__name__})"
    engines = os.path.join(ck, "engines")
    if not os.path.isdir(engines) or not any(os.scandir(engines)):
        return "no engine state"
    for d in os.scandir(engines):
        if d.is_dir() and not any(os.scandir(d.path)):
            return f"engine state of {d.name} is empty"
    return None


def checkpoints(run_dir: str) -> list[str]:
    """Every ``step_N`` directory of ``run_dir``, newest first."""
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    found = [(int(m.group(1)), os.path.join(r, n)) for n in os.listdir(r) if (m := _STEP.match(n))]
    return [p for _, p in sorted(found, reverse=True)]


def latest(run_dir: str, skipped: list | None = None) -> str | None:
    """The newest checkpoint of ``run_dir`` that reads back whole (``None`` when there is
    none); the newer ones that do not are appended to ``skipped`` as ``(dir, why)``."""
    for ck in checkpoints(run_dir):
        why = problem(ck)
        if why is None:
            return ck
        if skipped is not None:
            skipped.append((ck, why))
    return None


def prune(run_dir: str, keep: int) -> list[str]:
    """``--keep-checkpoints K``: delete every complete checkpoint but the newest ``keep``
    (``keep`` >= 1), after a newer one is complete. Only checkpoints that read back whole
    (:func:`problem` is None) count, so the one a resume would take (:func:`latest`) is never
    deleted; an unreadable one is left as it is (resume skips it and says so). A checkpoint is
    renamed to ``.del-step_N`` before it is removed: a kill mid-way never leaves a ``step_N``
    that looks complete but is not (``.del-`` leftovers are removed at the next resume).
    Returns the deleted directories."""
    keep = max(1, int(keep))
    whole = [ck for ck in checkpoints(run_dir) if problem(ck) is None]
    gone = []
    for ck in whole[keep:]:
        doomed = os.path.join(root(run_dir), DEL_PREFIX + os.path.basename(ck))
        if os.path.exists(doomed):
            shutil.rmtree(doomed)
        os.rename(ck, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        gone.append(ck)
    return gone


def prepare_resume(run_dir: str, samples_per_step: int) -> dict | None:
    """Pick the newest complete checkpoint, drop unfinished ones, log what is discarded.

    Returns ``{"dir", "version", "first_row", "metrics", "train_rows"}`` or ``None`` (nothing
    to resume)."""
    r = root(run_dir)
    if os.path.isdir(r):
        for name in os.listdir(r):
            if name.startswith((TMP_PREFIX, DEL_PREFIX)):
                shutil.rmtree(os.path.join(r, name), ignore_errors=True)
    skipped: list = []
    ck = latest(run_dir, skipped)
    if ck is None:
        return None
    with open(os.path.join(ck, STATE_FILE)) as f:
        state = json.load(f)
    version = int(state["version"])
    metrics = _read_jsonl(os.path.join(ck, "metrics.jsonl"))
    rows = _read_jsonl(os.path.join(ck, TRAIN_ROWS))
    seen = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    discarded = sorted({int(m["step"]) for m in seen if int(m.get("step", -1)) >= version})
    try:
        with open(os.path.join(ck, "store.json")) as f:
            regenerated = int(json.load(f).get("generated_rows_past", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        regenerated = 0
    with open(os.path.join(run_dir, RESUME_LOG), "a") as f:
        f.write(json.dumps({"time": time.time(), "checkpoint": os.path.basename(ck),
                            "version": version, "discarded_steps": discarded,
                            "regenerated_rows": regenerated,
                            "skipped": [[os.path.basename(d), why] for d, why in skipped]}) + "\n")
    _write_jsonl(os.path.join(run_dir, TRAIN_ROWS), rows)
    first_row = int(state.get("first_row", version * int(samples_per_step)))
    return {"dir": ck, "version": version, "first_row": first_row, "metrics": metrics,
            "train_rows": rows}


class TrainRowsLog:
    """``RUN_DIR/train_rows.jsonl``: the rows of every train step, appended as steps finish."""

    def __init__(self, run_dir: str | None, rows: list[dict] | None = None):
        self.rows: list[dict] = list(rows or [])
        self._f = None
        if run_dir:
            self._f = open(os.path.join(run_dir, TRAIN_ROWS), "a" if rows is not None else "w")

    def append(self, step: int, task: str, rows: list[int]) -> None:
        rec = {"step": int(step), "task": task, "rows": [int(x) for x in rows]}
        self.rows.append(rec)
        if self._f:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


# ------------------------------------------------------------------ helpers
def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the kill
                pass
    return out


def fsync_tree(path: str) -> None:
    """fsync every file below ``path``, then every directory (before the rename publishes it)."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (best effort: some file systems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

