"""The ``deepspeed`` engine: the ``hf`` engine's model, batches and losses, trained through
``deepspeed.initialize`` with ZeRO stage 1, 2 or 3, data-parallel over the task's replicas.

``DeepSpeedEngine(spec)`` is an :class:`~asyncflow.engines.hf.HFEngine` whose ``train`` kind
replaces the torch optimiser loop with a DeepSpeed engine; the model building, the packed
layout (:mod:`asyncflow.engines.torch_common`), the micro-batch loss (``HFEngine._micro_loss``,
which calls :func:`asyncflow.algos.compute_loss`) and ``export_weights`` are the hf engine's.
As a scorer (``kind: logprob | value``) it *is* the hf engine: DeepSpeed adds nothing to a
forward pass without gradients on one device.

Task args it reads, besides the hf engine's (``lr``, ``betas``, ``weight_decay``,
``adam_eps``, ``micro_batch``, ``max_grad_norm``, ``threads``, loss settings), all declared in
:data:`asyncflow.argtable.DEEPSPEED_ARGS` (which ``asyncflow check`` checks them against):

=================  ==============  =============================================================
arg                default         meaning
=================  ==============  =============================================================
``zero_stage``     1               ZeRO stage: 1 (optimizer states partitioned), 2 (+ grads),
                                   3 (+ parameters)
``master_addr``    127.0.0.1       rendezvous host of the data-parallel group (replica 0's)
``master_port``    a free port     rendezvous port; with ``replicas > 1`` every replica must
                   (1 replica),    get the same one (``spec.extra["master_port"]`` also works)
                   29500
``dist_backend``   the             ``gloo`` on CPU, ``nccl`` on GPU
                   accelerator's
``dist_timeout``   600             seconds a collective may wait for the other replicas
``ds_config``      {}              merged over the generated DeepSpeed config (expert use)
=================  ==============  =============================================================

**Data parallelism.** Replica ``spec.replica`` of ``spec.replicas`` is rank ``replica`` of a
``replicas``-rank process group (the engine sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` so no launcher is needed: :mod:`.deepspeed_setup`, which also
builds the DeepSpeed config). Every replica calls ``train_step``
once per step with its own rows: its share of the step, which the plan gives it (lower rule 8),
perhaps none. The replicas first agree on the step's number of
micro-batches; each micro-batch loss is multiplied by the world size (DeepSpeed averages
gradients over ranks) and the sum divided by the *global* normalizer (tokens for token-mean
losses, sequences otherwise, summed over the replicas at the end), so the update equals one
replica's on the whole global batch, whatever the split. A replica with fewer micro-batches
runs zero-loss ones so the collectives line up. Metrics are the global step's (identical on
every replica).

**Gradient accumulation.** One DeepSpeed step per ``train_step`` or ``train_stream``: the
accumulation boundary is set by hand (``set_gradient_accumulation_boundary``), so a step may
have any number of micro-batches (``gradient_accumulation_steps`` stays 1). ``train_step``
knows its micro-batches (token-balanced, as the hf engine's) and sets the boundary on the last
one; ``train_stream`` does not know which is last, so every micro-batch runs off the boundary
and a zero-loss micro-batch (one token) closes the step on it. Each micro-batch loss is taken
*unnormalised* (as the hf engine's, :mod:`asyncflow.engines.torch_common`, "train steps") and
the step's normaliser, known at the end, is applied through the ZeRO optimiser's loss scale:
``step`` divides every gradient by it after computing the global norm and before clipping
(``unscale_and_clip_grads``; ``get_global_grad_norm`` is the unscaled norm), so the scale is
multiplied by the normaliser for that one ``step`` and divided back after it (a dynamic fp16
scale keeps its own updates). Clipping is DeepSpeed's (``gradient_clipping`` =
``max_grad_norm``, on the global norm); the optimiser is ``torch.optim.AdamW``, which ZeRO
shards.

**Streaming over replicas.** ZeRO 2 reduces gradients in every backward, so the replicas run
their micro-batches in lock-step: before each, they agree (one small all-gather) on whether any
still has one with tokens; one that has none (its stream ended, or its micro-batch has no
tokens) runs a zero-loss micro-batch meanwhile, and the step ends when every stream has ended.
This path is untested where deepspeed is not installed.

**ZeRO-3** partitions the parameters as well: the module's parameters hold nothing outside a
gather. After every step (and at start) all replicas gather them and rank 0 keeps a CPU copy:
``export_weights`` (the weight sync) returns it, and ``export`` and ``save`` put it into the
module's parameters while they write (and take it out again). Only rank 0 publishes and exports
(lower rule 7) and a gather needs every rank, so it cannot wait for those calls.

**bfloat16.** A model loaded in bfloat16 (``dtype: bfloat16``) turns on DeepSpeed's ``bf16``
mode: bf16 weights, forward and backward, fp32 master weights in the ZeRO optimizer; the sync
and the export carry bf16 weights (float16: DeepSpeed's ``fp16`` mode, untested).

**Checkpoints** hold no pickles. ``save(dir)`` writes the model as a local HF directory (rank 0;
usable as a model ``init``) and, on every replica (each must call it), its part of the ZeRO
optimizer: ``dir/deepspeed/rank_R.safetensors`` (the fp32 master weights of its partition, the
AdamW moments, the sampling RNG) and ``rank_R.json`` (the rest of DeepSpeed's optimizer state
dict -- flags, counters, param groups, paddings -- with the loss scale and the version).
``load(dir)`` reads them back (safetensors and JSON only) through the ZeRO optimizer's
``load_state_dict`` with its fp32 weights; with ZeRO 1/2, rank 0 first reads the model into the
module and broadcasts it (ZeRO-3 rebuilds its parameters from the fp32 partitions). The number
of replicas and the stage must be the checkpoint's. ``export(dir, dtype)`` (the hf engine's)
writes the final model; the worker calls it on replica 0 only (:mod:`asyncflow.runtime.export`).

**On CPU** DeepSpeed uses its cpu accelerator and ``gloo``. Its first process group on a machine
JIT-builds DeepSpeed's shared-memory comm op (about a minute on 2 cores, then cached under
``~/.cache/torch_extensions``; skipped where there is no C++ compiler).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from asyncflow import models
from asyncflow.engines import torch_common as tc
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Columns, EngineSpec
from asyncflow.engines.deepspeed_setup import (DEFAULT_PORT, ds_config, init_distributed,
                                               release_distributed)
from asyncflow.engines.hf import VALUE_HEAD, HFEngine
from asyncflow.hfdir import VALUE_HEAD_FILE

__all__ = ["DeepSpeedEngine", "CKPT_TAG", "DEFAULT_PORT", "release_distributed"]

CKPT_TAG = "deepspeed"


class _Net(torch.nn.Module):
    """What DeepSpeed wraps: the causal LM (and value head), forwarded by the hf engine's
    ``_forward`` so the numbers are the hf engine's."""

    def __init__(self, owner: HFEngine):
        super().__init__()
        self.model = owner.model
        if owner.value_head is not None:
            self.value_head = owner.value_head
        self._forward = functools.partial(HFEngine._forward, owner)

    def forward(self, packed: tc.Packed) -> torch.Tensor:
        return self._forward(packed)


class DeepSpeedEngine(HFEngine):
    """A trainer through DeepSpeed ZeRO 1/2/3; a scorer as the hf engine (module docstring)."""

    # its replicas form one torch.distributed group: the worker gives each the group's meeting
    # point (replica 0's node address and a free port there) and the rank's local device
    # index (asyncflow.runtime.devices: Ray's assignment is the process's only device, 0)
    capabilities = BUILTIN_CAPABILITIES["deepspeed"]

    def __init__(self, spec: EngineSpec):
        self.ds = None  # the deepspeed engine (train kind only)
        super().__init__(spec)

    # ------------------------------------------------------------------ setup

    def _build_trainer(self) -> None:
        import deepspeed  # optional: only a deepspeed trainer needs it

        super()._build_trainer()  # loss settings, dropout off, AdamW over the parameters
        a = self.args
        stage = int(a.get("zero_stage", 1))
        if stage not in (1, 2, 3):
            raise ValueError(f"task {self.spec.task!r}: zero_stage must be 1, 2 or 3, not {stage}")
        self.stage = stage
        self.world, self.rank = init_distributed(self.spec, a)
        config = ds_config(stage, self.micro_batch, self.max_grad_norm,
                           next(self.model.parameters()).dtype, a.get("ds_config") or {})
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=_Net(self), optimizer=self.optimizer, config=config,
            dist_init_required=False)
        self._full = None  # ZeRO-3: rank 0's gathered weights after the last step
        self._gather()

    # ------------------------------------------------------------------ Trainer

    def _forward(self, packed: tc.Packed):
        if self.ds is not None and torch.is_grad_enabled():
            return self.ds(packed)  # through DeepSpeed: its backward hooks need its forward
        return super()._forward(packed)

    def train_step(self, batch: Columns) -> dict[str, float]:
        """One DeepSpeed step on this replica's rows of the global batch, in token-balanced
        micro-batches (module docstring). Metrics as the hf engine's, of the global step."""
        self._require_ds()
        return self._ds_train(self._split(batch), planned=True)

    def train_stream(self, micro_batches: Iterable[Columns]) -> dict[str, float]:
        """One DeepSpeed step over micro-batches that arrive one by one (as the hf engine's
        ``train_stream``; module docstring, "Streaming over replicas")."""
        self._require_ds()
        return self._ds_train(self._stream(micro_batches), planned=False)

    def _require_ds(self) -> None:
        if self.ds is None:
            raise RuntimeError(f"task {self.spec.task!r} is not a train task")

    def _ds_train(self, micro_batches: Iterable[tc.Micro], planned: bool) -> dict[str, float]:
        """The step of ``train_step`` (``planned``: all micro-batches known, their number agreed
        up front, the boundary on the last) and ``train_stream`` (agreed one at a time, closed
        by a zero-loss micro-batch on the boundary)."""
        step = tc.StepSums()
        if planned:
            micro_batches = list(micro_batches)
            for mb in micro_batches:
                step.add_rows(mb)
            work = [mb for mb in micro_batches if mb.tokens]
            rounds = self._max_over_replicas(len(work))
            source = iter(work)
        else:
            source = iter(micro_batches)
        done = 0  # micro-batches run (the same on every replica)
        while True:
            mb = next(source, None)
            if planned:
                if done == rounds:
                    break
                mine = mb is not None
            else:
                if mb is not None:
                    step.add_rows(mb)
                state = 0 if mb is None else 2 if mb.tokens else 1
                top = self._max_over_replicas(state)
                if top == 0:  # every stream has ended
                    break
                if top == 1:  # nobody has a token this round: nothing to run
                    continue
                mine = state == 2
            self.ds.set_gradient_accumulation_boundary(planned and done == rounds - 1)
            if mine:
                packed = mb.pack(self.tokenizer.pad_id)
                loss, metrics = self._micro_loss(packed, mb.cols, 1, self.micro_cfg)
                # DeepSpeed averages gradients over ranks; the step's sum is over all of them
                self.ds.backward(loss * self.world)
                step.add_metrics(metrics, packed.tokens)
                del loss, packed
            else:
                self._zero_backward()
            done += 1
        step = self._merge_over_replicas(step)
        if done == 0:  # no replica has a token: no update (as the hf engine), same version
            self.version += 1
            return {"loss": 0.0, "kl": 0.0, "grad_norm": 0.0, "tokens": 0.0,
                    "rows": float(step.rows), "version": float(self.version)}
        if not planned:  # the last micro-batch ran off the boundary: close the step on it
            self.ds.set_gradient_accumulation_boundary(True)
            self._zero_backward()
        norm = step.normaliser(self.loss_agg, self.loss_cfg.norm_length)
        with _loss_scale_times(self.optimizer, norm):
            self.ds.step()
        self.version += 1
        self._gather()
        grad_norm = self.ds.get_global_grad_norm()
        return step.result(norm, float(grad_norm) if grad_norm is not None else float("nan"),
                           self.version)

    def _max_over_replicas(self, value: int) -> int:
        if self.world == 1:
            return value
        out: list = [None] * self.world
        dist.all_gather_object(out, int(value))
        return max(out)

    def _merge_over_replicas(self, step: tc.StepSums) -> tc.StepSums:
        if self.world == 1:
            return step
        out: list = [None] * self.world
        dist.all_gather_object(out, step)
        return tc.StepSums.merged(out)

    def _zero_backward(self) -> None:
        """A micro-batch that adds nothing: keeps this replica's collectives in step with
        replicas that have more micro-batches."""
        bos = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.pad_id
        packed = tc.pack([[bos]], [[self.tokenizer.eos_id]], self.tokenizer.pad_id)
        self.ds.backward(self._forward(packed).sum() * 0.0)

    # ------------------------------------------------------------------ ZeRO-3 weights

    def _params(self):
        return super()._params() if self.ds is None else list(self.ds.module.parameters())

    def _gather(self) -> None:
        """ZeRO-3 (parameters partitioned over the replicas): every replica takes part in
        gathering the full weights after each step, and rank 0 keeps a CPU copy of them: the
        weight sync, the export and the checkpoint's model are rank 0's alone (lower rule 7),
        and a gather needs every rank. ZeRO 1/2 leave every rank the full weights: nothing."""
        if self.ds is None or self.stage != 3:
            return
        import deepspeed  # optional: only a deepspeed trainer needs it

        params = list(self.ds.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            self._full = HFEngine.export_weights(self) if self.rank == 0 else None

    def export_weights(self) -> dict:
        if self.ds is None or self.stage != 3:
            return super().export_weights()
        if self._full is None:
            raise RuntimeError(f"task {self.spec.task!r}: only replica 0 holds the gathered "
                               "ZeRO-3 weights")
        return {k: v.clone() for k, v in self._full.items()}

    @contextlib.contextmanager
    def _host_weights(self):
        """The module's parameters are the full weights inside (ZeRO-3 on rank 0: its gathered
        copy, put in and taken out again; otherwise they already are)."""
        if self.ds is None or self.stage != 3:
            yield
            return
        named = [(n, p) for n, p in self.model.named_parameters()]
        if self.value_head is not None:
            named += [(VALUE_HEAD + n, p) for n, p in self.value_head.named_parameters()]
        held = [p.data for _, p in named]
        full = self.export_weights()
        try:
            for (n, p), data in zip(named, held):
                p.data = full[n].to(data.device)
            yield
        finally:
            for (_, p), data in zip(named, held):
                p.data = data

    def export(self, directory: str, dtype: str = "float32") -> None:
        with self._host_weights():
            super().export(directory, dtype)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str) -> None:
        """The model as a local HF directory (replica 0) and, for every replica, its part of
        the ZeRO optimizer -- fp32 master weights and AdamW moments of its partition -- as
        ``deepspeed/rank_R.safetensors`` with the rest of its state (counters, flags, param
        groups, version) in ``deepspeed/rank_R.json``: no pickles (module docstring)."""
        if self.ds is None:
            return super().save(directory)
        os.makedirs(os.path.join(directory, CKPT_TAG), exist_ok=True)
        if self.rank == 0:
            with self._host_weights():
                models.save((self.model, self.tokenizer), directory)
                self._save_value_head(directory)
        sd = dict(self.optimizer.state_dict())
        scaler = sd.pop("loss_scaler", None)
        sd.pop("param_slice_mappings", None)  # for DeepSpeed's universal checkpoints only
        tensors: dict = {"generator": self.generator.get_state()}
        tree = _encode(sd, tensors, "optimizer")
        meta = {"format": 1, "version": self.version, "world": self.world, "rank": self.rank,
                "stage": self.stage, "optimizer": tree,
                "loss_scale": float(getattr(scaler, "cur_scale", 1.0) or 1.0),
                "counters": {k: int(getattr(self.ds, k, 0) or 0)
                             for k in ("global_steps", "global_samples", "skipped_steps")}}
        base = os.path.join(directory, CKPT_TAG, f"rank_{self.rank}")
        save_file(tensors, base + ".safetensors", metadata={"format": "pt"})
        with open(base + ".json", "w") as f:
            json.dump(meta, f)

    def load(self, directory: str) -> None:
        if self.ds is None:
            return super().load(directory)
        base = os.path.join(directory, CKPT_TAG, f"rank_{self.rank}")
        if not os.path.exists(base + ".json"):
            raise FileNotFoundError(f"no DeepSpeed checkpoint of rank {self.rank} in {directory}")
        with open(base + ".json") as f:
            meta = json.load(f)
        if (meta["world"], meta["stage"]) != (self.world, self.stage):
            raise ValueError(
                f"task {self.spec.task!r}: the checkpoint in {directory} was saved by "
                f"{meta['world']} replicas with ZeRO stage {meta['stage']}, not "
                f"{self.world} with stage {self.stage}")
        tensors = load_file(base + ".safetensors")
        if self.stage != 3:  # the module's weights (ZeRO-3 rebuilds them from the fp32 ones)
            self._load_module(directory)
        sd = _decode(meta["optimizer"], tensors)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "cur_scale"):
            scaler.cur_scale = meta["loss_scale"]
        sd["loss_scaler"] = scaler
        self.optimizer.load_state_dict([sd] * self.world, load_optimizer_states=True,
                                       load_from_fp32_weights=True)
        for k, v in meta["counters"].items():
            setattr(self.ds, k, v)
        self.version = int(meta["version"])
        self.generator.set_state(tensors["generator"])
        self._gather()

    def _load_module(self, directory: str) -> None:
        """ZeRO 1/2: rank 0 reads the checkpoint's model (its HF directory's safetensors) into
        the module and broadcasts every parameter to the other ranks."""
        if self.rank == 0:
            state = {}
            for name in sorted(os.listdir(directory)):
                if name.endswith(".safetensors") and name.startswith("model"):
                    state.update(load_file(os.path.join(directory, name)))
            if self.value_head is not None:
                head = os.path.join(directory, VALUE_HEAD_FILE)
                state.update({VALUE_HEAD + k: v for k, v in load_file(head).items()})
            with torch.no_grad():
                self._load_state(state)
        if self.world > 1:
            with torch.no_grad():
                for p in self._params():
                    dist.broadcast(p.data, src=0)


@contextlib.contextmanager
def _loss_scale_times(optimizer, factor: float):
    """The ZeRO optimiser's loss scale multiplied by ``factor`` for one ``step``: it divides
    every gradient by its loss scale (module docstring, "Gradient accumulation")."""
    before = optimizer.loss_scale
    optimizer.loss_scale = before * factor
    if optimizer.loss_scale != before * factor:  # e.g. an external (custom) loss scale
        optimizer.loss_scale = before
        raise RuntimeError("the DeepSpeed optimiser's loss scale cannot be set; the step's "
                           "normaliser cannot be applied (use the fp32 ZeRO 1/2 optimiser)")
    try:
        yield
    finally:
        optimizer.loss_scale = optimizer.loss_scale / factor


def _encode(v, tensors: dict, path: str):
    """A state tree as JSON, its tensors moved to ``tensors`` under their path (``{"__t":
    path}``); tuples and dicts with non-string keys kept apart so :func:`_decode` rebuilds it."""
    if torch.is_tensor(v):
        tensors[path] = v.detach().to("cpu").clone().contiguous()
        return {"__t": path}
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float)):  # an IntEnum (ZeRO's stage) as its number
        return int(v) if isinstance(v, int) else float(v)
    if isinstance(v, (list, tuple)):
        items = [_encode(x, tensors, f"{path}.{i}") for i, x in enumerate(v)]
        return {"__tuple": items} if isinstance(v, tuple) else items
    if isinstance(v, dict):
        return {"__items": [[k if isinstance(k, str) else int(k),
                             _encode(x, tensors, f"{path}.{k}")] for k, x in v.items()]}
    raise TypeError(f"cannot store {type(v).__name__} at {path} in a checkpoint without pickles")


def _decode(v, tensors: dict):
    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if isinstance(v, dict):
        if "__t" in v:
            return tensors[v["__t"]]
        if "__tuple" in v:
            return tuple(_decode(x, tensors) for x in v["__tuple"])
        return {k: _decode(x, tensors) for k, x in v["__items"]}
    return v
