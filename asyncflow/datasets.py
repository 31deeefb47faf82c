"""Data sources: generated verifiable tasks and the loaders of data as users keep it (no torch).

A source in a pipeline's ``data:`` is one of (docs/language.md, "Data sources"):

==========================  ======================================================================
source                      read by
==========================  ======================================================================
``module:factory``          the factory, called with ``args``; it returns a list of row dicts
``x.jsonl``                 :func:`jsonl`: one JSON object a line
``x.json``                  :func:`json_file`: a JSON array of objects (or JSON lines)
``x.parquet``               :func:`parquet` (``pyarrow``, the ``data`` extra)
a directory                 :func:`directory`: written by ``datasets`` ``save_to_disk`` (a
                            ``Dataset``, or a ``DatasetDict`` whose split ``split:`` names), or
                            any directory ``datasets.load_dataset`` reads (data files by split)
``org/name[@revision]``     :func:`hub`: a Hugging Face hub data set, its ``split:``, through the
                            ``datasets`` library (the ``data`` extra); under ``HF_HUB_OFFLINE=1``
                            only from the local cache
==========================  ======================================================================

Every loader returns plain Python rows (``str``, ``int``, ``float``, ``bool``, ``None``, lists and
dicts: no numpy or arrow values), so a chat prompt -- a list of ``{role, content}`` messages --
reaches the tasks as written whatever the format. A source with several splits and no ``split:``
is an error that lists them (:class:`SplitError`), as is a split it does not have.

The cheap look-ups ``check`` uses (:func:`saved_splits`, :func:`hub_cached`, :func:`has_data_files`)
only read file names and small JSON files: they import neither ``datasets`` nor ``pyarrow``.
Every generator is deterministic in its ``seed``.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from asyncflow import modelsrc

# the file suffixes a source may end in, and the data files a load_dataset-able directory holds
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
DIR_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt", ".tsv")
# a hub data set id: org/name, optionally @revision (a directory of that name wins over the hub);
# written as a model's hub id is
HUB_DATA_ID = modelsrc.HUB_ID

DIGITS_TASKS = ("add", "copy", "reverse")


def digits(n: int = 10000, seed: int = 0, task: str = "add", max_operand: int = 4,
           length: int = 3) -> list[dict]:
    """``n`` short digit problems, each ``{"prompt", "answer"}``.

    - ``add`` (default): ``"3+4="`` -> ``"7"``, operands in ``0..max_operand``. With the default
      4 the answers are single digits 0..8: from random init, GRPO (32 prompts x 8 samples,
      lr 1e-3, exact-match reward) takes a 2-layer, hidden-64 decoder from 0.4% to
      ~50% exact in ~160 steps on a CPU (~40 s). ``max_operand=9`` (answers 0..18) learns
      several times slower.
    - ``copy``: ``"copy 417="`` -> ``"417"`` (``length`` digits).
    - ``reverse``: ``"rev 417="`` -> ``"714"``.
    """
    if task not in DIGITS_TASKS:
        raise ValueError(f"digits task must be one of {DIGITS_TASKS}, got {task!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if task == "add":
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        else:
            s = "".join(rng.choice("0123456789") for _ in range(length))
            if task == "copy":
                rows.append({"prompt": f"copy {s}=", "answer": s})
            else:
                rows.append({"prompt": f"rev {s}=", "answer": s[::-1]})
    return rows


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
_THINGS = ("apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles")


def math_qa(n: int = 1000, seed: int = 0, max_value: int = 20) -> list[dict]:
    """``n`` one-step word problems with an integer answer, ``{"prompt", "answer"}``; the
    prompt asks for the answer as ``\\boxed{}`` (what :func:`asyncflow.rewards.math_answer_match`
    reads first)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        kind = rng.randrange(4)
        if kind == 0:
            q, ans = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", a + b
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            q, ans = f"{name} has {a} {thing} and gives away {b}. How many are left?", a - b
        elif kind == 2:
            q, ans = f"{name} buys {a} boxes of {b} {thing}. How many {thing} in total?", a * b
        else:
            q, ans = f"{a} friends share {a * b} {thing} equally. How many does each get?", b
        rows.append({"prompt": q + " Put the answer in \\boxed{}.", "answer": str(ans)})
    return rows


def jsonl(path: str, fields: list[str] | None = None) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped); ``fields`` keeps only those keys and
    requires them on every row."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: a row must be a JSON object")
            rows.append(_select(row, fields, f"{path}:{lineno}"))
    return rows


def json_file(path: str, fields: list[str] | None = None) -> list[dict]:
    """Rows of a ``.json`` file: an array of objects, or JSON lines (as ``datasets`` reads both)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object a line in a .json file
            return jsonl(path, fields)
        raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}: the one list it holds
    if not isinstance(data, list):
        raise ValueError(f"{path}:1: a .json source is an array of objects, not a {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: item {i} is a {type(row).__name__}, not an object")
    return [_select(r, fields, path) for r in data]


def parquet(path: str, fields: list[str] | None = None) -> list[dict]:
    """Rows of a Parquet file (needs ``pyarrow``, in the ``data`` extra)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'asyncflow[data]'") from None
    table = pq.read_table(path, columns=list(fields) if fields else None)
    return [_select(plain(r), fields, path) for r in table.to_pylist()]


# -- data set directories and hub data sets (the `datasets` library) ------------------------------
class SplitError(ValueError):
    """A ``split:`` the source does not have, or none given where it has several."""

    def __init__(self, message: str, splits: list[str]):
        super().__init__(message)
        self.splits = splits


def saved_splits(path: str | os.PathLike) -> list[str] | None:
    """The splits of a ``save_to_disk`` directory: a DatasetDict's names, a single Dataset's own
    split (``[]`` when it has none), None when ``path`` is not such a directory (cheap: reads one
    small JSON file)."""
    p = Path(path)
    if (p / "dataset_dict.json").is_file():
        try:
            return list(json.loads((p / "dataset_dict.json").read_text(encoding="utf-8"))["splits"])
        except (ValueError, KeyError, TypeError, OSError):
            return None
    if (p / "state.json").is_file():
        try:
            split = json.loads((p / "state.json").read_text(encoding="utf-8")).get("_split")
        except (ValueError, AttributeError, OSError):
            return None
        return [str(split)] if split else []
    return None


def has_data_files(path: str | os.PathLike, depth: int = 3, budget: int = 2000) -> bool:
    """Whether a directory holds a data file ``datasets.load_dataset`` can read (by suffix, up to
    ``depth`` levels down, hidden directories skipped; past ``budget`` entries, assumed so)."""
    todo = [(Path(path), depth)]
    while todo and budget > 0:
        p, left = todo.pop(0)
        try:
            entries = sorted(p.iterdir())[:budget]
        except OSError:
            continue
        budget -= len(entries)
        for e in entries:
            if e.name.lower().endswith(DIR_DATA_SUFFIXES) and e.is_file():
                return True
            if left > 0 and not e.name.startswith(".") and e.is_dir():
                todo.append((e, left - 1))
    return budget <= 0  # too large to look through: not known to hold nothing


def offline() -> bool:
    """Whether the Hugging Face libraries are told not to reach the network (for data sets,
    ``HF_DATASETS_OFFLINE`` too): :func:`asyncflow.modelsrc.offline`."""
    return modelsrc.offline("HF_DATASETS_OFFLINE")


def hub_caches() -> list[Path]:
    """Where a hub data set may be cached: huggingface_hub's cache (the repository's files, as
    for models: :func:`asyncflow.modelsrc.cache_dir`) and the ``datasets`` cache (prepared arrow
    files), as the environment sets them."""
    ds = os.environ.get("HF_DATASETS_CACHE")
    return [Path(modelsrc.cache_dir()),
            Path(ds).expanduser() if ds else Path(modelsrc.hf_home()) / "datasets"]


def hub_snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of hub data set ``repo`` at ``revision`` (a branch, tag or
    commit; default ``main``) in huggingface_hub's cache, or None (no import, no network)."""
    root = hub_caches()[0] / ("datasets--" + repo.replace("/", "--"))
    rev = revision or "main"
    ref = root / "refs" / rev
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8").strip()
    snap = root / "snapshots" / rev
    return snap if snap.is_dir() else None


def hub_cached(repo: str, revision: str | None = None) -> bool:
    """Whether ``repo`` can be loaded without the network: a snapshot in huggingface_hub's cache,
    or a data set ``datasets`` prepared before in its own cache (``org___name``)."""
    if hub_snapshot(repo, revision) is not None:
        return True
    org, _, name = repo.partition("/")
    snake = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)).lower()
    return (hub_caches()[1] / f"{org}___{snake}").is_dir()


def directory(path: str, split: str | None = None, **kwargs: Any) -> list[dict]:
    """Rows of a data set directory: one ``save_to_disk`` wrote (``datasets.load_from_disk``),
    else one ``datasets.load_dataset`` reads (its data files, split by their names); ``kwargs``
    go to ``load_dataset``."""
    ds = _datasets(path)
    if saved_splits(path) is not None:
        return _rows(_pick(ds.load_from_disk(path), split, path))
    return _rows(_pick(ds.load_dataset(path, **kwargs), split, path))


def hub(source: str, split: str | None = None, **kwargs: Any) -> list[dict]:
    """Rows of hub data set ``org/name[@revision]`` through ``datasets.load_dataset`` (``kwargs``:
    its keywords, e.g. ``name`` for a configuration). Under ``HF_HUB_OFFLINE=1`` the repository's
    cached snapshot is read where huggingface_hub has one, else ``datasets``' own cache."""
    m = HUB_DATA_ID.match(source)
    if m is None:
        raise ValueError(f"'{source}' is not a hub data set id org/name[@revision]")
    repo, rev = m.group("repo"), m.group("rev")
    ds = _datasets(source)
    if offline() and not hub_cached(repo, rev):
        raise OSError(f"hub data set '{repo}' is not in the local Hugging Face cache "
                      f"({' nor '.join(map(str, hub_caches()))}) and HF_HUB_OFFLINE is set")
    snap = hub_snapshot(repo, rev) if offline() else None
    target = str(snap) if snap is not None else repo
    if snap is None and rev:
        kwargs["revision"] = rev
    base = split.split("[")[0] if split else None
    try:  # only the split asked for: a hub data set's other splits are not downloaded
        loaded = ds.load_dataset(target, split=base, **kwargs)
    except ValueError as e:
        if "Unknown split" not in str(e) and "Bad split" not in str(e):
            raise
        names = re.findall(r"'([^']+)'", str(e).split("Should be one of", 1)[-1])
        raise SplitError(f"{source} has no split '{split}'" + (f" (it has {', '.join(names)})" if names else ""),
                         names) from None
    return _rows(_pick(loaded, split, source))


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading {what} needs the datasets library: pip install 'asyncflow[data]'") from None
    datasets.disable_progress_bars()  # the run draws its own progress; no bars per split read
    return datasets


def _pick(loaded, split: str | None, where: str):
    """The Dataset of ``split`` in what ``datasets`` loaded (a Dataset, or a DatasetDict)."""
    if not hasattr(loaded, "keys"):  # one Dataset: there is nothing to pick
        own = [str(loaded.split)] if loaded.split else []
        if split is not None and split.split("[")[0] not in own:
            raise SplitError(f"{where} is one data set ({f'split {own[0]}' if own else 'no split names'}): "
                             f"drop `split: {split}`", own)
        return loaded.select(_slice(split, len(loaded))) if split and "[" in split else loaded
    names = [str(k) for k in loaded.keys()]
    if split is None:
        if len(names) == 1:
            return loaded[names[0]]
        raise SplitError(f"{where} has the splits {', '.join(names)}: say which with `split:`", names)
    base = split.split("[")[0]  # "train[:10%]": datasets' slicing of a split
    if base not in names:
        raise SplitError(f"{where} has no split '{split}' (it has {', '.join(names)})", names)
    if base != split:
        return loaded[base].select(_slice(split, len(loaded[base])))
    return loaded[split]


def _slice(spec: str, n: int) -> range:
    """The rows ``train[a:b]`` (counts or percentages) names in a split of ``n`` rows."""
    m = re.fullmatch(r"[\w.-]+\[(-?\d+%?)?:(-?\d+%?)?\]", spec)
    if m is None:
        raise ValueError(f"split '{spec}': a slice is written name[start:stop], e.g. train[:100] or train[:10%]")

    def at(v: str | None, default: int) -> int:
        if v is None:
            return default
        k = round(n * int(v[:-1]) / 100) if v.endswith("%") else int(v)
        return max(0, min(n, k + n if k < 0 else k))

    return range(at(m.group(1), 0), at(m.group(2), n))


def _rows(ds) -> list[dict]:
    """A Dataset's rows as plain Python (whatever format was set on it)."""
    return [plain(r) for r in ds.with_format(None).to_list()]


def plain(v: Any) -> Any:
    """``v`` with numpy / arrow values made plain Python (arrays -> lists, scalars -> items), and
    the keys a chat message only has because arrow gave every message of a column the union of
    their keys (``None`` values of a ``{role, content, ...}`` dict inside a list) dropped."""
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_message(plain(x)) for x in v]
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # numpy array or scalar
        return plain(v.tolist())
    if hasattr(v, "as_py"):  # a pyarrow scalar
        return plain(v.as_py())
    return v


def _message(x: Any) -> Any:
    if isinstance(x, dict) and "role" in x and "content" in x:
        return {k: v for k, v in x.items() if v is not None or k in ("role", "content")}
    return x


def _select(row: dict, fields, where: str) -> dict:
    if not fields:
        return row
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: row has no field(s) {', '.join(missing)}")
    return {f: row[f] for f in fields}
