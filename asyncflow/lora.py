"""LoRA adapters (``models.<m>.lora``): the trainer trains a low-rank adapter instead of the
model's weights, as peft's ``LoraConfig`` describes it, and a weight sync sends only the adapter.

Keys (all optional: ``lora: {}`` is an adapter with every default)::

    r               rank of the update, an integer >= 1 (default 8)
    alpha           scale numerator: the update is (alpha / r) B A (default 2 r)
    dropout         dropout on the adapter's input while training, in [0, 1) (default 0)
    target_modules  the linear layers that get an adapter: a list of module names
                    (["q_proj", "v_proj"]) or "all-linear" (default: "all-linear")

Where it runs (``engine: hf``): the trainer wraps its model with peft (``get_peft_model``: the
base weights frozen, the optimiser over the adapter only) and publishes the adapter's tensors
only; a rollout or scorer fed by it through a sync edge wraps its own copy of the base model
with the same adapter (B = 0 at first: the base model's outputs) and loads each one it receives.
The adapter is applied unmerged on both sides, so the rollout's log-probs are exactly the
trainer's (the staleness-0 equivalence stays bit-exact; merging into the weights would change
them by rounding at every sync). A frozen copy (``copy_of``) is the base model, without it: the
KL anchor. The export writes the merged model (``final/<m>/``, loadable without peft) and the
adapter (``final/<m>/adapter/``, peft's ``adapter_config.json`` + ``adapter_model.safetensors``).

The compiler checks the keys (AF214) and that every engine that trains or receives the adapter
takes one (AF215); this module imports no torch or peft until an engine needs them.
"""
from __future__ import annotations

from typing import Any

KEYS = ("r", "alpha", "dropout", "target_modules")
DEFAULT_R = 8
ENGINES = ("hf", "vllm")  # the engines that train or apply an adapter (vllm: a rollout, as
#                            an adapter request: asyncflow.engines.vllm)


def problems(spec: Any) -> list[tuple[str, str]]:
    """``[(key, problem)]`` of a ``lora:`` map (key "" for the map itself); [] when fine."""
    if not isinstance(spec, dict):
        return [("", "must be a map of r, alpha, dropout, target_modules")]
    out = []
    for k, v in spec.items():
        if k not in KEYS:
            out.append((k, f"is not a LoRA key (the keys: {', '.join(KEYS)})"))
        elif k == "r" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            out.append((k, f"must be an integer >= 1, not {v!r}"))
        elif k == "alpha" and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
            out.append((k, f"must be a number > 0, not {v!r}"))
        elif k == "dropout" and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                 or not 0 <= v < 1):
            out.append((k, f"must be a number in [0, 1), not {v!r}"))
        elif k == "target_modules" and not (v == "all-linear" or (
                isinstance(v, list) and v and all(isinstance(x, str) and x for x in v))):
            out.append((k, f"must be \"all-linear\" or a list of module names, not {v!r}"))
    return out


def resolve(spec: dict | None) -> dict:
    """The adapter with its defaults filled in; {} for no adapter (no ``lora`` key)."""
    if not isinstance(spec, dict):
        return {}
    r = int(spec.get("r", DEFAULT_R))
    tm = spec.get("target_modules", "all-linear")
    return {"r": r, "alpha": float(spec.get("alpha", 2 * r)),
            "dropout": float(spec.get("dropout", 0.0)),
            "target_modules": tm if tm == "all-linear" else list(tm)}


# ---------------------------------------------------------------------- runtime (torch, peft)
def wrap(model, engine_spec, train: bool):
    """``model`` with a fresh adapter, ``engine_spec.model["lora"]`` (peft): B = 0, so it
    computes what ``model`` does until an adapter is trained or loaded. A trainer's base weights
    are frozen. An adapter peft cannot put on the model (a ``target_modules`` name it does not
    have) is AF653, located at the model's ``init``, naming the model's linear layers."""
    import warnings

    from peft import LoraConfig, get_peft_model

    import torch

    from asyncflow.models import LOAD_LOCK

    spec = engine_spec.model["lora"]
    cfg = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                     target_modules=spec["target_modules"], bias="none", task_type="CAUSAL_LM")
    try:
        # peft draws A from torch's process-wide generator: seeded (the same adapter every run)
        # and under the load lock, so that it never draws in the middle of another colocated
        # engine's seeded model initialisation (a thread of the local backend): that changed
        # the other model's initial weights
        with LOAD_LOCK, torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft reads transformers' deprecated ``is_gradient_checkpointing``: a FutureWarning
            # the user can do nothing about (their run does not use the name)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            torch.manual_seed(int((engine_spec.model.get("args") or {}).get("seed", 0)) + 2)
            peft_model = get_peft_model(model, cfg)
    except ValueError as e:  # peft's NoMatchingPeftModuleError among them
        from types import SimpleNamespace

        from asyncflow.errors import TaskError

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        at = SimpleNamespace(name=engine_spec.task, loc=engine_spec.model.get("loc", ""))
        raise TaskError("AF653", at, model=engine_spec.model.get("name", "?"),
                        reason=str(e).splitlines()[0], linear=", ".join(linear)) from None
    if not train:
        peft_model.requires_grad_(False)
    return peft_model


def adapter_state(model) -> dict:
    """The adapter's tensors (CPU copies): what a sync sends."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def load_adapter(model, state: dict) -> None:
    """Load adapter tensors from :func:`adapter_state` into a wrapped model (every one must fit)."""
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(res, "unexpected_keys", []) or [])
    if unexpected:
        raise KeyError(f"adapter tensors do not fit the model: unexpected {unexpected[:5]}")


def merged_copy(model):
    """A plain transformers model with the adapter merged into its weights (the wrapped model
    is not changed): what the export writes."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def save_adapter(model, directory: str) -> None:
    """peft's adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)."""
    model.save_pretrained(directory)
