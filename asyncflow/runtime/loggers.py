"""The loggers a run writes to, beside ``metrics.jsonl``: TensorBoard (always, where it is
installed), Weights & Biases and MLflow (``asyncflow run --log wandb --log mlflow``).

Every logger is one small :class:`Logger`: ``start(config)`` once before the first step (the
pipeline's settings), ``log(step, metrics)`` once per train step (the ``metrics.jsonl`` row:
nested maps flattened to ``utilization/rollout``; ``eval/...`` keys go the same way),
``text(step, samples)`` at the steps ``samples.jsonl`` is written (:mod:`asyncflow.runtime.
samples`), ``finish(status)`` once at the end. :class:`Loggers` is the group the driver talks
to: one logger that fails while the run goes on is switched off with a warning naming it (the
run and the other loggers go on); one that cannot start is an error before any worker starts.

=============  ============================================================================
logger         where it writes
=============  ============================================================================
tensorboard    ``RUN_DIR/tensorboard/``: scalars, samples in the text tab
wandb          the real ``wandb`` library: online when an API key is set (``WANDB_API_KEY``
               or ``wandb login``), else offline into ``RUN_DIR/wandb/`` (``WANDB_DIR``
               overrides; ``wandb sync`` uploads it later); ``WANDB_MODE`` is obeyed;
               ``WANDB_PROJECT`` names the project (default: the pipeline's name); samples
               as a ``samples`` table
mlflow         the real ``mlflow`` library (``asyncflow[mlflow]``: mlflow-skinny): the
               server ``MLFLOW_TRACKING_URI`` names, else a local file store
               ``RUN_DIR/mlruns`` (``mlflow ui --backend-store-uri RUN_DIR/mlruns``); one
               run per ``asyncflow run`` in the experiment named by
               ``MLFLOW_EXPERIMENT_NAME`` (default: the pipeline's name); samples as the
               artifacts ``samples/step_N.jsonl``
=============  ============================================================================

A logger whose library is not installed is AF670 (with the ``pip install`` line); an unknown
name AF671; a library that fails to start AF672.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Protocol

#: ``--log`` names -> (the module that must be importable, the extra that installs it)
LIBRARIES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}


class Logger(Protocol):
    name: str

    def start(self, config: dict) -> None: ...

    def log(self, step: int, metrics: dict) -> None: ...

    def text(self, step: int, samples: list[dict]) -> None: ...

    def finish(self, status: str = "finished") -> None: ...


def scalars(row: dict, prefix: str = ""):
    """(name, number) pairs of a metrics row; nested maps become ``utilization/rollout``;
    ``step``, text, None and non-finite numbers are left out."""
    for k, v in row.items():
        if k == "step" and not prefix:
            continue
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from scalars(v, name + "/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            yield name, v


def run_config(plan_dict: dict, **extra) -> dict:
    """What a logger records as the run's settings: the pipeline as the user wrote it (step,
    models, data, tasks with their args, sync), not the compiled schedule."""
    keep = ("pipeline", "seed", "step", "models", "data", "sync")
    cfg = {k: plan_dict[k] for k in keep if k in plan_dict}
    tasks = plan_dict.get("tasks") or []
    cfg["tasks"] = {t.get("name"): {k: t[k] for k in ("kind", "engine", "model", "loss",
                                                         "estimator", "fn", "args", "replicas")
                                    if t.get(k) not in (None, {}, [])}
                    for t in tasks if isinstance(t, dict)}
    cfg.update(extra)
    return cfg


def flat(d: Any, prefix: str = "") -> dict[str, str]:
    """``{"tasks.update.args.lr": "0.0001", ...}``: a nested config as flat strings (MLflow
    params)."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)) and any(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            out.update(flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = json.dumps(d) if not isinstance(d, str) else d
    return out


def sample_markdown(samples: list[dict]) -> str:
    """Samples as Markdown (TensorBoard's text tab renders it): per sample its row, reward and
    version, then the prompt and the completion in code blocks."""
    parts = []
    for s in samples:
        head = " · ".join(f"{k} {s[k]}" for k in ("row", "reward", "version") if k in s)
        prompt = s.get("prompt")
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        parts.append(f"**{head}**\n\nprompt:\n\n```\n{prompt}\n```\n\ncompletion:\n\n```\n"
                     f"{s.get('completion')}\n```")
    return "\n\n---\n\n".join(parts)


# -- TensorBoard ------------------------------------------------------------------------------
FLUSH_S = 1.0  # the event file is flushed at most this often (TensorBoard reloads every 5 s)


class TensorBoard:
    """TensorBoard event files in ``directory``, written with the ``tensorboard`` package's own
    event writer and protos (:class:`_EventWriter`), not torch's ``SummaryWriter``: importing
    torch in the run's process holds the GIL for about half a second, which, on the local
    backend, froze every worker thread at once (a lease renewed every 0.1 s expired under it).
    The writer is made in a thread of its own, started by the first call, so its import (0.2 s)
    does not sit on the run's start-up; what comes before it is ready is written once it is (at
    the latest on :meth:`finish`). A step's scalars are one event, and the file is flushed at
    most every :data:`FLUSH_S` seconds (and on :meth:`finish`): an event per scalar and a flush
    per step cost the driver 1.6 ms of CPU a step (about 30 scalars). Without tensorboard
    installed it writes nothing."""

    name = "tensorboard"

    def __init__(self, directory: str):
        self.directory = directory
        self._tb = None
        self._queue: list[tuple] = []  # ("scalars" | "text", step, payload) not yet written
        self._flushed = float("-inf")  # when the event file was last flushed (monotonic)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, config: dict) -> None:
        pass

    def _make(self) -> None:
        writer = _tensorboard_writer(self.directory)
        with self._lock:
            self._tb = writer
            if writer is None:
                self._queue = []
                return
        self._write()

    def _write(self) -> None:
        with self._lock:
            if self._tb is None:
                if self._thread is not None and not self._thread.is_alive():
                    self._queue = []  # no writer could be made (tensorboard not installed)
                return
            items, self._queue = self._queue, []
            for what, step, payload in items:
                if what == "scalars":  # one event holds the step's every scalar
                    self._tb.add_scalars(scalars(payload), step)
                else:
                    self._tb.add_text("samples", payload, step)
            now = time.monotonic()
            if items and now - self._flushed >= FLUSH_S:
                self._tb.flush()
                self._flushed = now

    def _put(self, item: tuple) -> None:
        with self._lock:
            self._queue.append(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._make, name="asyncflow-tensorboard",
                                            daemon=True)
            self._thread.start()
        self._write()

    def log(self, step: int, metrics: dict) -> None:
        self._put(("scalars", step, metrics))

    def text(self, step: int, samples: list[dict]) -> None:
        if samples:
            self._put(("text", step, sample_markdown(samples)))

    def finish(self, status: str = "finished") -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._write()
            with self._lock:
                if self._tb is not None:
                    self._tb.close()
                    self._tb = None


def _tensorboard_writer(directory: str):
    """An :class:`_EventWriter`, or None where tensorboard is not installed (it is optional)."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    try:
        return _EventWriter(directory)
    except ImportError as e:  # a broken optional install must not stop a run: say so, once
        print(f"asyncflow: TensorBoard is off, its package does not import ({e})", file=sys.stderr)
        return None


class _EventWriter:
    """What the logger writes, on tensorboard's ``EventFileWriter`` (the event files torch's
    ``SummaryWriter`` writes, without torch): a step's scalars as one event
    (:meth:`add_scalars`: each a ``simple_value``), a text as a string tensor under
    ``<tag>/text_summary`` with the text plugin's metadata, as TensorBoard's text tab reads it;
    ``flush``/``close``."""

    def __init__(self, directory: str):
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._tensor, self._shape, self._event = summary_pb2, tensor_pb2, tensor_shape_pb2, Event
        self._w = EventFileWriter(directory)

    def _add(self, values: list, step: int) -> None:
        """One event of step ``step`` whose summary holds ``values``."""
        self._w.add_event(self._event(wall_time=time.time(), step=int(step),
                                      summary=self._pb.Summary(value=values)))

    def add_scalars(self, pairs, step: int) -> None:
        """(tag, value) pairs of one step as one event: a summary of several values, as a
        merged TensorFlow summary is (TensorBoard reads each value as its tag's point)."""
        values = [self._pb.Summary.Value(tag=k, simple_value=float(v)) for k, v in pairs]
        if values:
            self._add(values, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        meta = self._pb.SummaryMetadata(plugin_data=self._pb.SummaryMetadata.PluginData(plugin_name="text"))
        shape = self._shape.TensorShapeProto(dim=[self._shape.TensorShapeProto.Dim(size=1)])
        tensor = self._tensor.TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                                          tensor_shape=shape)
        self._add([self._pb.Summary.Value(tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)], step)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


# -- Weights & Biases -------------------------------------------------------------------------
SAMPLE_COLUMNS = ("step", "row", "prompt", "completion", "reward", "version")


def wandb_mode(environ=os.environ) -> str:
    """``WANDB_MODE`` where set; else online with an API key (``WANDB_API_KEY`` or a
    ``wandb login`` entry in ~/.netrc), offline without one."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc) as f:
            if "api.wandb.ai" in f.read():
                return "online"
    except OSError:
        pass
    return "offline"


class Wandb:
    """One wandb run per ``asyncflow run`` (module docstring)."""

    name = "wandb"

    def __init__(self, run_dir: str, run_name: str | None = None):
        self.run_dir, self.run_name = run_dir, run_name
        self.run = None
        self.mode = wandb_mode()
        self.where = ""

    def start(self, config: dict) -> None:
        import wandb

        directory = os.environ.get("WANDB_DIR") or os.path.abspath(self.run_dir)
        os.makedirs(directory, exist_ok=True)
        project = os.environ.get("WANDB_PROJECT") or config.get("pipeline") or "asyncflow"
        self.run = wandb.init(project=project, name=self.run_name, config=config,
                              dir=directory, mode=self.mode)
        self.where = (f"offline in {os.path.dirname(self.run.dir)} (wandb sync uploads it)"
                      if self.mode == "offline" else f"{self.mode}: {getattr(self.run, 'url', '')}")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(dict(scalars(metrics)), step=step)

    def text(self, step: int, samples: list[dict]) -> None:
        import wandb

        rows = [[_cell(s.get(c, step if c == "step" else None)) for c in SAMPLE_COLUMNS]
                for s in samples]
        self.run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)},
                     step=step)

    def finish(self, status: str = "finished") -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)
            self.run = None


def _cell(v):
    return v if isinstance(v, (str, int, float)) or v is None else json.dumps(v, ensure_ascii=False)


# -- MLflow -----------------------------------------------------------------------------------
class Mlflow:
    """One MLflow run per ``asyncflow run`` (module docstring), through ``MlflowClient`` (no
    global active run)."""

    name = "mlflow"

    def __init__(self, run_dir: str, run_name: str | None = None):
        self.run_dir, self.run_name = run_dir, run_name
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or ""
        self.client = None
        self.run_id = None
        self.where = ""

    def start(self, config: dict) -> None:
        if not self.uri:
            # mlflow-skinny has no database store; its file store is opt-in since MLflow 3
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.uri = "file://" + os.path.abspath(os.path.join(self.run_dir, "mlruns"))
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.get("pipeline") or "asyncflow"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=self.run_name)
        self.run_id = run.info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in sorted(flat(config).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.where = f"{self.uri} (experiment {name!r}, run {self.run_id})"

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, step) for k, v in scalars(metrics)]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def text(self, step: int, samples: list[dict]) -> None:
        body = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        self.client.log_text(self.run_id, body, f"samples/step_{step}.jsonl")

    def finish(self, status: str = "finished") -> None:
        if self.client is not None and self.run_id is not None:
            state = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
            self.client.set_terminated(self.run_id, state)
            self.run_id = None


MAKERS: dict[str, Callable[..., Any]] = {"wandb": Wandb, "mlflow": Mlflow}


# -- the group --------------------------------------------------------------------------------
class Loggers:
    """The loggers of a run as one :class:`Logger`. A logger that raises in ``log``/``text``/
    ``finish`` is switched off with one warning (``warn``) naming it and the error; the run
    and the other loggers go on."""

    name = "loggers"

    def __init__(self, loggers: list, warn: Callable[[str], Any] | None = None):
        self.loggers = list(loggers)
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr))
        self.failed: dict[str, str] = {}  # logger -> why it was switched off

    def __bool__(self) -> bool:
        return bool(self.loggers)

    @property
    def names(self) -> list[str]:
        return [lg.name for lg in self.loggers]

    def start(self, config: dict) -> None:
        """Start every logger; one that cannot is AF672 (nothing of the run has started)."""
        from asyncflow.diagnostics import error

        for lg in self.loggers:
            try:
                lg.start(config)
            except Exception as e:  # the library's own error, whatever its class
                self.finish("failed")
                raise error("AF672", None, name=lg.name,
                            error=f"{e.__class__.__name__}: {e}") from None

    def _each(self, method: str, *args) -> None:
        for lg in list(self.loggers):
            try:
                getattr(lg, method)(*args)
            except Exception as e:  # a logger's fault must not end the training run
                self.loggers.remove(lg)
                why = f"{e.__class__.__name__}: {e}"
                self.failed[lg.name] = why
                self.warn(f"logger {lg.name} failed in {method} and is switched off: {why}")

    def log(self, step: int, metrics: dict) -> None:
        self._each("log", step, metrics)

    def text(self, step: int, samples: list[dict]) -> None:
        if samples:
            self._each("text", step, samples)

    def finish(self, status: str = "finished") -> None:
        self._each("finish", status)


def make(names, run_dir: str, run_name: str | None = None,
         warn: Callable[[str], Any] | None = None) -> Loggers:
    """The loggers ``--log`` names (``tensorboard`` is always on: naming it is allowed and
    changes nothing); checked before anything starts: an unknown name is AF671, a library that
    is not installed AF670."""
    from asyncflow.diagnostics import did_you_mean, error

    out, seen = [], set()
    for name in names or ():
        key = str(name).strip().lower()
        if key not in LIBRARIES:
            raise error("AF671", None, did_you_mean(key, LIBRARIES), name=name,
                        known=", ".join(LIBRARIES))
        if key in seen or key == "tensorboard":
            seen.add(key)
            continue
        seen.add(key)
        module, extra = LIBRARIES[key]
        if not _installed(module):
            raise error("AF670", None, f"pip install 'asyncflow[{extra}]'", name=key,
                        module=module, extra=extra)
        out.append(MAKERS[key](run_dir, run_name))
    return Loggers(out, warn)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules (None) or broken
        return False
