"""The run directory's rules: nothing a user gave is lost, mixed or overwritten without ``--force``.

``asyncflow run`` calls :func:`claim` before it starts anything:

- a lock (``RUN_DIR/.lock``, ``flock``) held for the life of the process: a second run into the
  same directory is AF623, naming the process that holds it;
- a manifest (``RUN_DIR/.asyncflow-manifest.json``, :data:`MANIFEST`) lists the run files
  (:data:`RUN_FILES`) this directory's runs made: every one that was not there when a run
  claimed the directory (a file the user had put there under such a name is never listed);
- ``--out`` into a directory that already holds a run (any of :data:`RUN_FILES`) is AF622 unless
  ``--resume`` (continue it) or ``--force``: the entries the manifest lists are removed first
  (so a later ``--resume`` can never pick the old run's checkpoint; in ``checkpoints/`` only
  the checkpoints themselves), and nothing else. A run file the manifest does not list (no
  manifest: none is listed) is the user's: ``--force`` refuses to run over it (AF624) and
  removes nothing;
- ``--resume DIR`` of a directory that holds no run, or no complete checkpoint, is AF620;
- ``--resume`` compares the newest readable checkpoint's ``plan.json`` with the plan about to
  run and refuses a changed plan with the list of differences (AF621) unless ``--force``. The
  number of steps may change (a run is extended by resuming it with more steps); the source
  file's path and the cost estimate are not part of the comparison.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from asyncflow.runtime import checkpoint

RUN_FILES = ("plan.json", "metrics.jsonl", "trace.json", "workers.json", "train_rows.jsonl",
             "resume.jsonl", "tensorboard", "samples.jsonl", checkpoint.CKPT_DIR,
             "final")  # RUN_DIR/final/<model>: the trained models (asyncflow.runtime.export)
# what the user wrote comes first in a plan's differences; what the compiler derived after
USER_KEYS = ("pipeline", "seed", "step", "models", "data", "pools", "tasks", "sync")
LOCK = ".lock"
MANIFEST = ".asyncflow-manifest.json"
IGNORED = (("source_file",), ("estimate",), ("step", "steps"))  # plan paths resume ignores


class Claim:
    """The held lock of a run directory (released when the process ends or on ``release``)."""

    def __init__(self, fd: int, notes: list[str]):
        self.fd, self.notes = fd, notes

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _err(code: str, hint: str | None = None, **fmt):
    from asyncflow.diagnostics import error

    return error(code, None, hint, **fmt)


def _lock(run_dir: str) -> int:
    import fcntl

    path = os.path.join(run_dir, LOCK)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise _err("AF623", run_dir=run_dir, pid=holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def holds_run(run_dir: str) -> list[str]:
    """The run files ``run_dir`` holds."""
    return [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]


def manifest(run_dir: str) -> list[str]:
    """The run files the manifest of ``run_dir`` lists as asyncflow's (none without one)."""
    got = _read(os.path.join(run_dir, MANIFEST))
    entries = got.get("entries") if isinstance(got, dict) else None
    return [e for e in entries if e in RUN_FILES] if isinstance(entries, list) else []


def _write_manifest(run_dir: str, entries: list[str]) -> None:
    """The manifest, atomically (tmp + rename)."""
    path = os.path.join(run_dir, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": 1, "entries": sorted(set(entries))}, f, indent=1)
    os.replace(path + ".tmp", path)


def _remove_ours(run_dir: str, entries: list[str]) -> list[str]:
    """Remove the run files ``entries`` (asyncflow's, by the manifest); in ``checkpoints/``
    only the checkpoints (and the directory if nothing else is left). Returns what went."""
    gone = []
    for f in entries:
        p = os.path.join(run_dir, f)
        if f == checkpoint.CKPT_DIR and os.path.isdir(p):
            for name in os.listdir(p):
                if checkpoint.is_checkpoint_name(name):
                    shutil.rmtree(os.path.join(p, name))
            if os.listdir(p):
                gone.append(f"{f}/ (its checkpoints; the rest stays)")
                continue
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
        else:
            continue
        gone.append(f)
    return gone


def claim(run_dir: str, plan: Any, *, resume: bool, force: bool) -> Claim:
    """Check and lock ``run_dir`` for a run of ``plan`` (a :class:`~asyncflow.plan.Plan`);
    raises a located-less AF62x :class:`~asyncflow.errors.UserError` when the rules say no."""
    notes: list[str] = []
    if resume and not os.path.isdir(run_dir):
        raise _err("AF620", run_dir=run_dir, why="the directory does not exist")
    os.makedirs(run_dir, exist_ok=True)
    fd = _lock(run_dir)
    try:
        found = holds_run(run_dir)
        if resume:
            skipped: list = []
            ck = checkpoint.latest(run_dir, skipped)
            for d, why in skipped:
                notes.append(f"checkpoint {os.path.basename(d)} is unreadable ({why}): skipped")
            if ck is None:
                why = ("it holds no asyncflow run" if not found else
                       "it holds a run but no complete checkpoint (run with --checkpoint-every K)")
                raise _err("AF620", run_dir=run_dir, why=why)
            diffs = plan_diff(_read(os.path.join(ck, "plan.json")), plan.to_dict())
            if diffs and not force:
                raise _err("AF621", ck=ck, n=len(diffs), diffs="; ".join(diffs[:12])
                           + (f"; ... ({len(diffs) - 12} more)" if len(diffs) > 12 else ""))
            if diffs:
                notes.append(f"the plan differs from {ck}'s in {len(diffs)} place(s): resuming "
                             "anyway (--force)")
            notes.append(f"resuming from {ck}")
        elif found and not force:
            hint = None
            if not {"metrics.jsonl", checkpoint.CKPT_DIR, "final"} & set(found):
                hint = ("the run there stopped before its first step ended (no metrics.jsonl, "
                        "no checkpoint): nothing to resume; --force replaces it")
            raise _err("AF622", hint=hint, run_dir=run_dir, files=", ".join(found))
        elif found:
            ours = manifest(run_dir)
            theirs = [f for f in found if f not in ours]
            if theirs:
                raise _err("AF624", run_dir=run_dir, files=", ".join(theirs))
            gone = _remove_ours(run_dir, [f for f in found if f in ours])
            notes.append(f"--force: removed the earlier run's {', '.join(gone)} from {run_dir}")
        # this run's files: the ones not there now (a file left under a run file's name is
        # listed only if an earlier run's manifest lists it)
        listed = manifest(run_dir)
        _write_manifest(run_dir, [f for f in RUN_FILES
                                  if f in listed or not os.path.exists(os.path.join(run_dir, f))])
    except BaseException:
        os.close(fd)
        raise
    return Claim(fd, notes)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def plan_diff(old: dict | None, new: dict) -> list[str]:
    """``path: old -> new`` for every difference between two plans' JSON (None: unknown)."""
    if old is None:
        return ["the checkpoint holds no plan.json"]
    out: list[str] = []

    def walk(a, b, path: tuple) -> None:
        if any(path[:len(i)] == i for i in IGNORED):
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k, "<absent>"), b.get(k, "<absent>"), path + (str(k),))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, path + (str(i),))
        elif a != b:
            out.append(f"{'.'.join(path) or 'plan'}: {_short(a)} -> {_short(b)}")

    walk(old, new, ())
    return sorted(out, key=lambda d: d.split(".")[0] not in USER_KEYS)


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= 40 else s[:37] + "..."
