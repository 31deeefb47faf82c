"""A trained model as a Hugging Face directory: what ``RUN_DIR/final/<model>/`` and
``asyncflow export`` write (:mod:`asyncflow.runtime.export` places it; engines call
:func:`write_hf`). Loadable by ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``. torch and safetensors are imported inside functions only."""
from __future__ import annotations

import json
import os
import time

from asyncflow.models import torch_dtype as to_torch_dtype

INFO = "asyncflow_export.json"
WEIGHTS = "model.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"


def write_hf(directory: str, model, tokenizer, dtype: str = "float32", value_head=None,
             info: dict | None = None) -> None:
    """Write ``model`` (a transformers causal LM) as a Hugging Face directory in ``dtype``:
    config (its ``dtype`` set), generation config, ``model.safetensors`` (the weights cast to
    ``dtype``; a tensor shared by several names, tied embeddings, stored once under its first
    name), the tokenizer (its own ``save``: transformers files and chat template), the critic's
    value head, and ``asyncflow_export.json``; a model of a checkpoint's own code (loaded with
    ``trust_remote_code``) with that code, as ``save_pretrained`` writes it. The model itself
    is not changed."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = to_torch_dtype(dtype)
    os.makedirs(directory, exist_ok=True)
    if getattr(model, "_auto_class", None) is not None:  # a checkpoint's own code (auto_map):
        from transformers.dynamic_module_utils import custom_object_save  # as save_pretrained

        custom_object_save(model, directory, config=model.config)  # copies it, sets auto_map
    model.config.save_pretrained(directory)
    set_config_dtype(directory, dtype)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(directory)
        except (ValueError, TypeError):  # a generation config transformers refuses to write
            pass
    seen: set = set()
    weights = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.numel() and key in seen:
                continue
            seen.add(key)
            weights[name] = cast_tensor(t, torch_dtype)
    save_file(weights, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    tokenizer.save(directory)
    if value_head is not None:
        write_value_head(directory, value_head, torch_dtype)
    write_info(directory, {**(info or {}), "dtype": dtype, "critic": value_head is not None})


def write_value_head(directory: str, value_head, torch_dtype=None) -> None:
    """A critic's linear value head as ``value_head.safetensors`` (``weight [1, hidden]``,
    ``bias [1]``), cast to ``torch_dtype`` (None: as it is)."""
    from safetensors.torch import save_file

    head = {k: cast_tensor(v, torch_dtype) for k, v in value_head.state_dict().items()}
    save_file(head, os.path.join(directory, VALUE_HEAD_FILE), metadata={"format": "pt"})


def cast_tensor(t, torch_dtype):
    """``t`` on the CPU, contiguous and copied, cast to ``torch_dtype`` if it is a float (None:
    as it is)."""
    t = t.detach().to("cpu")
    if torch_dtype is not None and t.is_floating_point():
        t = t.to(torch_dtype)
    return t.contiguous().clone()


def set_config_dtype(directory: str, dtype: str) -> None:
    """Say ``dtype`` in ``directory``'s ``config.json`` (``dtype``, and ``torch_dtype`` where the
    file has that older key)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_info(directory: str, info: dict) -> None:
    """``asyncflow_export.json`` of an exported directory: ``info`` and the time."""
    with open(os.path.join(directory, INFO), "w") as f:
        json.dump({**info, "time": time.time()}, f, indent=1, sort_keys=True)
        f.write("\n")
