"""Your trained model out: Hugging Face directories of every trained model.

Layout::

    RUN_DIR/final/<model>/               written at the end of every run (the last train step)
                                         and refreshed at each checkpoint
        config.json                      its ``dtype`` is the model's ``dtype:`` (float32 default)
        generation_config.json           where the model has one
        model.safetensors                the weights in that dtype (tied weights stored once)
        tokenizer files                  the engine tokenizer's ``save`` (chat template included)
        value_head.safetensors           critics only (below)
        asyncflow_export.json            where it came from: run, task, model, version, dtype
    RUN_DIR/checkpoints/step_N/engines/<task>_0/   a checkpoint's trainer state: also a
                                         Hugging Face directory (float32, plus optimizer state)
    RUN_DIR/export/step_N/<model>/       ``asyncflow export RUN_DIR [--step N]``: the clean copy
                                         of a checkpoint (or of final/), without optimizer state

``final/<model>`` is written by the train worker that holds the weights (replica 0 of the task
that trains the model; with DeepSpeed ZeRO 1/2 every rank holds the full weights, and only rank 0
writes) right after its last step's PUBLISH, so it holds exactly the weights of the last published
version; also at each checkpoint (``--checkpoint-every K``), so a run killed later leaves its
newest trained model there (``asyncflow_export.json`` says which version). It is written into ``final/.tmp-<model>``, every file fsynced, then renamed into place
(a previous ``final/<model>`` is moved aside first and deleted after): a kill leaves either the
old or the new export, never half of one. The worker reports the path with its last step; the
run summary prints it.

Older checkpoints are not exported again: a checkpoint's ``engines/<task>_0`` already is a
transformers-loadable directory; ``asyncflow export --step N`` turns one into the model's dtype
without the optimizer state (:func:`from_checkpoint`), on demand.

A critic (a train task with ``loss: value``) exports its base causal LM as above plus
``value_head.safetensors``: ``weight`` ``[1, hidden]`` and ``bias`` ``[1]`` of the linear head
that maps the base model's last hidden state at a position to the value ``V(s_t)``.
``AutoModelForCausalLM`` loads the base model and ignores the head's file.

torch, safetensors and transformers are imported inside functions only.
"""
from __future__ import annotations

import json
import os
import shutil

FINAL = "final"
EXPORTS = "export"
from asyncflow.hfdir import INFO, VALUE_HEAD_FILE, cast_tensor, set_config_dtype, write_info
from asyncflow.models import torch_dtype as to_torch_dtype
#: what a checkpoint's engine directory holds that an export leaves out (optimizer, RNG,
#: DeepSpeed's shards and helper script)
NOT_EXPORTED = ("engine_state.pt", "latest", "zero_to_fp32.py")
ADAPTER_DIR = "adapter"  # a LoRA model's adapter (asyncflow.lora), exported beside the merged model
_TMP = ".tmp-"
_OLD = ".old-"


# ------------------------------------------------------------------ what is trained
def trained(plan) -> list[tuple[str, str]]:
    """``(train task, model)`` for every model a train task trains (the first such task),
    from a :class:`~asyncflow.plan.Plan` or its dict (a checkpoint's ``plan.json``)."""
    out: dict[str, str] = {}
    for t in _get(plan, "tasks") or ():
        if _get(t, "kind") == "train" and _get(t, "model"):
            out.setdefault(_get(t, "model"), _get(t, "name"))
    return [(task, model) for model, task in out.items()]


def dtype_of(plan, model: str) -> str:
    """The model's ``dtype:`` in the plan (float32 where the plan has none)."""
    for m in _get(plan, "models") or ():
        if _get(m, "name") == model:
            return str(_get(m, "dtype") or "float32")
    return "float32"


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def final_dir(run_dir: str, model: str) -> str:
    return os.path.join(run_dir, FINAL, model)


def finals(run_dir: str) -> dict[str, str]:
    """``{model: directory}`` of the final exports of ``run_dir`` (complete ones only)."""
    root = os.path.join(run_dir, FINAL)
    if not os.path.isdir(root):
        return {}
    return {n: os.path.join(root, n) for n in sorted(os.listdir(root))
            if not n.startswith(".") and os.path.exists(os.path.join(root, n, INFO))}


# ------------------------------------------------------------------ atomic placement
def place(tmp: str, final: str) -> str:
    """fsync every file of ``tmp``, then make it ``final`` by renames (an existing ``final`` is
    moved aside first and deleted after): ``final`` is at every moment absent, old or new."""
    from asyncflow.runtime.checkpoint import fsync_path, fsync_tree

    fsync_tree(tmp)
    parent = os.path.dirname(final)
    old = None
    if os.path.exists(final):
        old = os.path.join(parent, _OLD + os.path.basename(final))
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fresh_tmp(parent: str, name: str) -> str:
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{_TMP}{name}-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    return tmp


# ------------------------------------------------------------------ the train worker's part
def write_final(engine, run_dir: str, plan, task: str, version: int) -> dict:
    """At the end of a run: the model that ``task`` trains, from its engine, into
    ``RUN_DIR/final/<model>``. Returns ``{"model", "dir", "dtype"}``, or ``{"model",
    "skipped": why}`` when the engine writes no model (it has no ``export`` method)."""
    model = next((m for t, m in trained(plan) if t == task), None)
    if model is None:
        return {}
    if not hasattr(engine, "export"):
        return {"model": model, "skipped": f"engine {type(engine).__name__} has no export()"}
    dtype = dtype_of(plan, model)
    final = final_dir(run_dir, model)
    tmp = _fresh_tmp(os.path.dirname(final), model)
    try:
        engine.export(tmp, dtype)
        write_info(tmp, {**_read_info(tmp), "source": "run", "run_dir": os.path.abspath(run_dir),
                          "task": task, "model": model, "version": int(version)})
        place(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"model": model, "dir": final, "dtype": dtype}


def _read_info(directory: str) -> dict:
    try:
        with open(os.path.join(directory, INFO)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------ from a checkpoint
class Unreadable(Exception):
    """A checkpoint's model files cannot be read (the message says which and why)."""


def from_checkpoint(engine_dir: str, out: str, dtype: str, info: dict) -> str:
    """A checkpoint's engine directory (a Hugging Face directory written by the engine's
    ``save``) as a clean export in ``out``: every ``*.safetensors`` cast to ``dtype``, the
    config's ``dtype`` set, the other files (tokenizer, generation config) and a LoRA run's
    ``adapter/`` copied; optimizer
    state, RNG and DeepSpeed shards left out. Atomic as :func:`place`."""
    if not os.path.exists(os.path.join(engine_dir, "config.json")):
        raise Unreadable(f"{engine_dir} holds no config.json (its engine wrote no model)")
    names = [n for n in sorted(os.listdir(engine_dir)) if n.endswith(".safetensors")]
    if not names:
        raise Unreadable(f"{engine_dir} holds no .safetensors weights")
    tmp = _fresh_tmp(os.path.dirname(os.path.abspath(out)), os.path.basename(out))
    os.makedirs(tmp)
    try:
        for name in sorted(os.listdir(engine_dir)):
            src = os.path.join(engine_dir, name)
            if os.path.isdir(src) and name == ADAPTER_DIR:  # a LoRA run's adapter, as peft wrote it
                shutil.copytree(src, os.path.join(tmp, name))
                continue
            if os.path.isdir(src) or name in NOT_EXPORTED or name.endswith(".pt"):
                continue
            if name.endswith(".safetensors"):
                _recast(src, os.path.join(tmp, name), dtype)
            else:
                shutil.copyfile(src, os.path.join(tmp, name))
        set_config_dtype(tmp, dtype)
        write_info(tmp, {**info, "dtype": dtype,
                          "critic": os.path.exists(os.path.join(tmp, VALUE_HEAD_FILE))})
        return place(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _recast(src: str, dst: str, dtype: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    torch_dtype = to_torch_dtype(dtype)
    try:
        weights = load_file(src)
    except (SafetensorError, OSError, ValueError) as e:
        raise Unreadable(f"{src}: {e}") from None
    save_file({k: cast_tensor(v, torch_dtype) for k, v in weights.items()}, dst,
              metadata={"format": "pt"})


def copy_final(src: str, out: str) -> str:
    """A final export copied as is (it already is the clean export), atomically."""
    tmp = _fresh_tmp(os.path.dirname(os.path.abspath(out)), os.path.basename(out))
    try:
        shutil.copytree(src, tmp)
        return place(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ asyncflow export RUN_DIR
def export_run(run_dir: str, step: int | None = None, out: str | None = None,
               force: bool = False, dtype: str | None = None) -> dict:
    """``asyncflow export``: every trained model of ``run_dir`` from checkpoint ``step``
    (default: the final export where the run finished, else the newest complete checkpoint)
    into ``out/<model>`` (default ``RUN_DIR/export/step_N``), in ``dtype`` (default: the
    model's ``dtype:``; e.g. bfloat16 to serve a model trained in float32). Returns ``{"step",
    "source", "out", "models": {model: {"dir", "dtype"}}}``. User errors AF660-AF664."""
    from asyncflow.runtime import checkpoint

    if not os.path.isdir(run_dir):
        raise _err("AF660", run_dir=run_dir, why="no such directory")
    cks = checkpoint.checkpoints(run_dir)
    done = finals(run_dir)
    if not (cks or done or os.path.exists(os.path.join(run_dir, "plan.json"))):
        raise _err("AF660", run_dir=run_dir,
                   why="it holds no plan.json, checkpoints/ or final/ (asyncflow run --out DIR "
                       "writes them)")
    final_step = _final_step(done)
    steps = sorted(int(os.path.basename(c).split("_")[1]) for c in cks)
    have = _have(steps, final_step)
    if step is None and done:
        source = "final"
        step = final_step
    elif step is not None and step == final_step and done:
        source = "final"
    elif step is None:
        skipped: list = []
        ck = checkpoint.latest(run_dir, skipped)
        if ck is None and skipped:
            raise _err("AF662", run_dir=run_dir, what=os.path.basename(skipped[0][0]),
                       why=skipped[0][1])
        if ck is None:
            raise _err("AF661", run_dir=run_dir, what="no final export and no checkpoint",
                       have="a run writes final/ at its end, and checkpoints with "
                            "--checkpoint-every K")
        source, step = os.path.basename(ck), int(os.path.basename(ck).split("_")[1])
    else:
        if int(step) not in steps:
            raise _err("AF661", run_dir=run_dir, what=f"no checkpoint of step {step}", have=have)
        source = f"step_{int(step)}"
    out = out or os.path.join(run_dir, EXPORTS, f"step_{step}")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise _err("AF663", out=out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise _err("AF663", out=out)
    if source == "final":
        models = {}
        for model, d in done.items():
            dst, info = os.path.join(out, model), _read_info(d)
            if dtype and dtype != info.get("dtype", "float32"):  # recast, as a checkpoint is
                try:
                    from_checkpoint(d, dst, dtype, info)
                except Unreadable as e:
                    raise _err("AF662", run_dir=run_dir, what="final", why=str(e)) from None
            else:
                copy_final(d, dst)
            models[model] = {"dir": dst, "dtype": dtype or info.get("dtype", "float32")}
        return {"step": step, "source": "final", "out": out, "models": models}
    ck = os.path.join(checkpoint.root(run_dir), source)
    why = checkpoint.problem(ck)
    if why is not None:
        raise _err("AF662", run_dir=run_dir, what=source, why=why)
    plan = _plan_dict(ck) or _plan_dict(run_dir)
    if plan is None:
        raise _err("AF662", run_dir=run_dir, what=source, why="plan.json unreadable")
    pairs = trained(plan)
    if not pairs:
        raise _err("AF664", run_dir=run_dir, why="its plan has no train task with a model")
    models = {}
    for task, model in pairs:
        src = checkpoint.engine_dir(ck, f"{task}/0")
        if not os.path.exists(os.path.join(src, "config.json")):
            engine = next((_get(t, "engine") for t in _get(plan, "tasks") if _get(t, "name") == task),
                          None)
            raise _err("AF664", run_dir=run_dir,
                       why=f"the engine of task '{task}' ({engine}) saved no model in {source} "
                           f"(no config.json in {src})")
        cast = dtype or dtype_of(plan, model)
        dst = os.path.join(out, model)
        try:
            from_checkpoint(src, dst, cast, {"source": "checkpoint", "run_dir":
                                              os.path.abspath(run_dir), "checkpoint": source,
                                              "task": task, "model": model, "version": int(step)})
        except Unreadable as e:
            raise _err("AF662", run_dir=run_dir, what=source, why=str(e)) from None
        models[model] = {"dir": dst, "dtype": cast}
    return {"step": step, "source": source, "out": out, "models": models}


def _final_step(done: dict[str, str]) -> int | None:
    versions = [_read_info(d).get("version") for d in done.values()]
    versions = [int(v) for v in versions if v is not None]
    return max(versions) if versions else None


def _have(steps: list[int], final_step: int | None) -> str:
    parts = []
    if steps:
        parts.append("checkpoint steps there: " + ", ".join(map(str, steps)))
    if final_step is not None:
        parts.append(f"the final export is step {final_step}")
    return "; ".join(parts) if parts else "it has no checkpoint and no final export"


def _plan_dict(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "plan.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _err(code: str, **fmt):
    from asyncflow.diagnostics import error

    return error(code, None, **fmt)
