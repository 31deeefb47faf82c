"""Where a model comes from: one rule, used by ``check``, ``compile`` and ``run`` alike.

A model's ``init:`` is, in this order:

1. ``module:factory`` -- a function returning ``(model, tokenizer)``, looked up on the run's
   search path (:mod:`asyncflow.refs`);
2. a directory: absolute, or relative to the pipeline file's directory, then the working
   directory (:func:`asyncflow.refs.find_file` with :func:`asyncflow.refs.search_path`);
3. a hub id ``org/name`` or ``org/name@revision``: a snapshot in the Hugging Face cache
   (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), found with
   ``huggingface_hub`` without touching the network; a run downloads one that is not cached,
   unless ``HF_HUB_OFFLINE=1`` (then an uncached id is an error at ``check``: AF345).

Anything else is AF344 (a value that is none of these), AF342 (a path that does not exist; an
``org/name`` whose ``org`` is a directory beside the pipeline is read as a path) or AF347 (a
file, not a model directory).

The compiler resolves it once (:func:`locate`) and the plan carries the result
(``ModelPlan.source_kind``, ``source``, ``path``): the runtime reads the weights from that
absolute directory, or calls that factory, and never resolves the text again against its own
working directory. Only a hub id that was not cached at compile time is looked up (and
downloaded) at start-up (:func:`fetch`).

Also here, read without importing torch or transformers: whether a directory's tokenizer has a
chat template (:func:`has_chat_template`), and whether a prompt value is a chat
(:func:`is_chat`).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

KINDS = ("factory", "directory", "hub")
REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(@(?P<rev>[\w./-]+))?$")
# an init written as a path (never read as a hub id)
PATH_PREFIXES = ("/", "./", "../", "~")
CKPT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"
TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Source:
    """A resolved ``init``: ``kind`` is one of :data:`KINDS`; ``ref`` the factory reference,
    the absolute directory, or the hub id (``org/name[@revision]``); ``path`` the local directory
    the weights are read from ("" for a factory, or a hub id not in the cache)."""

    kind: str
    ref: str
    path: str = ""

    def describe(self) -> str:
        """One line for ``check`` and ``compile``: where the model will come from."""
        if self.kind == "factory":
            return f"factory {self.ref}"
        if self.kind == "directory":
            return f"directory {self.path}"
        if self.path:
            return f"hub {self.ref} (cached: {self.path})"
        return f"hub {self.ref} (not cached: downloaded at start-up)"


class SourceError(Exception):
    """An ``init`` that names no model: ``code`` and ``fields`` fill the diagnostics table's
    message (AF342, AF344, AF345, AF347 at ``check``; AF650 at run time)."""

    def __init__(self, code: str, **fields: Any):
        self.code, self.fields = code, fields
        super().__init__(f"{code} {fields}")


def offline(*also: str) -> bool:
    """``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it once, at its import), or any of
    the variables ``also`` names (``HF_DATASETS_OFFLINE`` for data sets)."""
    return any(os.environ.get(k, "").strip().lower() in TRUE for k in ("HF_HUB_OFFLINE", *also))


def hf_home() -> str:
    """``HF_HOME``, else ``$XDG_CACHE_HOME/huggingface`` (default ``~/.cache/huggingface``)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.expanduser(home)


def cache_dir() -> str:
    """The Hugging Face hub cache as the environment says now (models and data sets alike):
    ``HF_HUB_CACHE`` (or its old name ``HUGGINGFACE_HUB_CACHE``), else ``hf_home()/hub``."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return os.path.expanduser(hub) if hub else os.path.join(hf_home(), "hub")


def split_hub_id(value: str) -> tuple[str, str | None] | None:
    """``(repo, revision)`` of ``org/name[@revision]``, or None when ``value`` is not one."""
    m = HUB_ID.match(value)
    return (m.group("repo"), m.group("rev")) if m else None


def cached_snapshot(repo: str, revision: str | None = None) -> str | None:
    """The snapshot directory of ``repo`` at ``revision`` (default ``main``) in the cache, or
    None; never touches the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with the hf extra
        return None
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache_dir(),
                                 local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None


def looks_like_path(value: str) -> bool:
    return value.startswith(PATH_PREFIXES) or value.endswith(CKPT_SUFFIXES)


def locate(init: str, paths: Sequence[str]) -> Source:
    """Resolve ``init`` (see the module docstring); ``paths`` is the search path
    (:func:`asyncflow.refs.search_path`: the pipeline's directory, then the working directory).
    Raises :class:`SourceError` (AF342, AF344, AF345) when it names no model."""
    from asyncflow.refs import find_file

    if REF.match(init):
        return Source("factory", init)
    found = find_file(init, paths)
    if found is not None and found.is_dir():
        return Source("directory", str(found.resolve()), str(found.resolve()))
    where = "the file system" if Path(init).expanduser().is_absolute() else " and ".join(paths)
    if found is not None:  # a file: a model is a directory (config.json + weights)
        raise SourceError("AF347", path=str(found.resolve()))
    hub = None if looks_like_path(init) else split_hub_id(init)
    if hub is not None and any((Path(b) / hub[0].split("/")[0]).is_dir() for b in paths):
        hub = None  # `ckpt/tiny-chat` with a `ckpt/` beside the pipeline: a path, not a hub id
    if hub is None:
        if looks_like_path(init) or "/" in init:
            raise SourceError("AF342", key="init", path=init, where=where)
        raise SourceError("AF344", value=init)
    repo, rev = hub
    snap = cached_snapshot(repo, rev)
    if snap is None and offline():
        raise SourceError("AF345", value=init, where=where, cache=cache_dir())
    return Source("hub", init, str(Path(snap).resolve()) if snap else "")


def fetch(src: Source) -> str:
    """The local directory of a resolved source at run time: a directory as the plan says; a
    hub id from the cache, downloaded first unless offline. Raises :class:`SourceError` AF650."""
    if src.kind == "directory" or (src.kind == "hub" and src.path and os.path.isdir(src.path)):
        if not os.path.isdir(src.path):
            raise SourceError("AF650", init=src.ref, reason=f"directory {src.path} does not exist")
        return src.path
    if src.kind != "hub":
        raise ValueError(f"fetch of a {src.kind} source")
    repo, rev = split_hub_id(src.ref) or (src.ref, None)
    snap = cached_snapshot(repo, rev)
    if snap is not None:
        return snap
    if offline():
        raise SourceError("AF650", init=src.ref,
                          reason=f"not in the Hugging Face cache {cache_dir()} and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, revision=rev, cache_dir=cache_dir())
    except Exception as e:  # the hub's answer (no such repo, gated, no network): the user's
        raise SourceError("AF650", init=src.ref,
                          reason=f"download failed: {e.__class__.__name__}: {e}") from None


# -- tokenizer files and chat prompts, read without transformers ------------------------------------
def is_chat(value: Any) -> bool:
    """Whether a prompt value is a chat: a non-empty list of ``{role, content}`` mappings."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def has_chat_template(directory: str) -> bool | None:
    """Whether the tokenizer saved in ``directory`` has a chat template (``chat_template.jinja``,
    ``chat_template.json``, or ``chat_template`` in ``tokenizer_config.json``); None when the
    directory holds no tokenizer files to read."""
    d = Path(directory)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    if (d / "additional_chat_templates").is_dir():
        return True
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except (OSError, ValueError):
            return None
        return bool(data.get("chat_template")) if isinstance(data, dict) else None
    if (d / "asyncflow_tokenizer.json").is_file():
        return False  # the character tokenizer: no template
    return None


def _chat_template(d: Path) -> str | None:
    """The default chat template saved in ``d``: ``chat_template.jinja``, ``chat_template.json``
    or ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: "default")."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (d / name).is_file():
            t = json.loads((d / name).read_text()).get("chat_template")
            if isinstance(t, list):
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str) and t:
                return t
    return None


def own_code(directory: str) -> str:
    """The code a checkpoint ships, as its ``auto_map`` names it ("AutoModelForCausalLM ->
    modeling_x.XForCausalLM, ..."), from ``config.json`` and ``tokenizer_config.json``; "" when
    it has none (transformers' own classes load it)."""
    out = []
    for name in ("config.json", "tokenizer_config.json"):
        f = Path(directory) / name
        try:
            amap = json.loads(f.read_text()).get("auto_map") if f.is_file() else None
        except (OSError, ValueError, AttributeError):
            continue
        for k, v in (amap or {}).items() if isinstance(amap, dict) else ():
            v = [x for x in v if x] if isinstance(v, (list, tuple)) else [v]
            out.append(f"{k} -> {', '.join(str(x) for x in v)}")
    return "; ".join(dict.fromkeys(out))


class TemplateRejects(Exception):
    """A chat template's own ``raise_exception(message)`` refused a prompt."""


@functools.lru_cache(maxsize=8)
def _saved_tokenizer(directory: str, mtime: float):
    """``(tokenizer, special tokens, template())`` of the tokenizer saved in ``directory``, read
    once per directory (and file time): ``check`` spells the first row of every data source
    back through it (a hub tokenizer.json takes a fraction of a second to read). ``template()``
    compiles the chat template, in a sandbox as transformers does, when first asked for."""
    from tokenizers import Tokenizer

    d = Path(directory)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text()) \
        if (d / "tokenizer_config.json").is_file() else {}
    special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}

    @functools.lru_cache(maxsize=1)
    def template():
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def fail(msg):
            raise TemplateRejects(str(msg))

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.globals["raise_exception"] = fail
        return env.from_string(_chat_template(d) or "")

    return tok, special, template


def spell_back(directory: str, prompt: Any) -> tuple[str, str] | None:
    """``(text, back)``: a prompt value as the tokenizer saved in ``directory`` sees it (a chat
    rendered with its template and the generation prompt, a string as is) and that text encoded
    and decoded again, special tokens kept -- where they differ, the tokenizer cannot encode a
    character (``check``'s AF348). Reads files with ``tokenizers`` and ``jinja2`` (the hf extra),
    never transformers; None when it cannot tell (no ``tokenizer.json``, the libraries missing,
    a template only transformers renders): the run checks the same at start-up (AF655) with the
    engine's own tokenizer. Raises :class:`TemplateRejects` when the template's own
    ``raise_exception`` refuses the chat (``check``'s AF349: e.g. "System role not supported")."""
    d = Path(directory)
    try:
        tok, special, template = _saved_tokenizer(str(d), (d / "tokenizer.json").stat().st_mtime)
        if is_chat(prompt):
            text = template().render(messages=[dict(m) for m in prompt],
                                     add_generation_prompt=True, **special)
            ids = tok.encode(text, add_special_tokens=False).ids
        else:
            text = str(prompt)
            ids = tok.encode(text).ids
        return text, tok.decode(ids, skip_special_tokens=False)
    except TemplateRejects:
        raise
    except Exception:  # noqa: BLE001 -- cannot tell here; start-up checks with transformers
        return None


__all__ = ["Source", "SourceError", "locate", "fetch", "is_chat", "has_chat_template", "spell_back",
           "TemplateRejects", "own_code", "DTYPES", "DEFAULT_DTYPE", "KINDS", "HUB_ID",
           "cached_snapshot", "cache_dir", "hf_home", "offline"]
