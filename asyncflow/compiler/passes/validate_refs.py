"""Validate rule 4: ``module:function`` references, model sources and data files resolve --
found and parsed, never imported (AF340-AF347, AF390-AF392). Part of
:mod:`asyncflow.compiler.passes.validate`."""
from __future__ import annotations

from pathlib import Path

from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.kinds.base import at as _at
from asyncflow.datasets import DATA_SUFFIXES  # the data files a source may be
from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl import ast
from asyncflow.dsl.build import REF_RE
from asyncflow.dsl.loc import SourceLoc
from asyncflow.engines.base import capabilities
from asyncflow.modelsrc import is_chat
from asyncflow.refs import find_file, find_module, search_path, top_level_names


def check_init(p: ast.Pipeline, m: ast.ModelDef, d: Diagnostics) -> None:
    """Where the model comes from, by the rule ``compile`` and ``run`` use
    (:func:`asyncflow.modelsrc.locate`: module:factory, a directory beside the pipeline or in
    the CWD, a hub id in the Hugging Face cache): AF340-AF342, AF344, AF345, AF347; then chat
    prompts its tokenizer cannot render (AF346) and prompts it cannot encode (AF348)."""
    from asyncflow.modelsrc import SourceError, locate

    v = m.init
    loc = _at(m, "init")
    if REF_RE.match(v):
        check_ref(p, v, "init", loc, d)
        return
    try:
        src = locate(v, bases(p))
    except SourceError as e:
        d.add(e.code, loc, **{"model": m.name, "value": v, **e.fields})
        return
    if src.path:
        _check_own_code(p, m, src.path, loc, d)
        _check_prompts(p, m, src.path, d)


def _check_own_code(p: ast.Pipeline, m: ast.ModelDef, directory: str, loc: SourceLoc,
                    d: Diagnostics) -> None:
    """AF339: a checkpoint that ships its own code (``auto_map`` in its ``config.json`` or
    ``tokenizer_config.json``) for a model without ``trust_remote_code: true``: transformers
    would refuse to load it at start-up, and running it is the user's decision."""
    from asyncflow.modelsrc import own_code

    code = own_code(directory)
    if code and not m.trust_remote_code:
        d.add("AF339", loc, "set trust_remote_code: true on the model if you trust that code "
              "(transformers runs it to build the model and its tokenizer)",
              model=m.name, path=directory, classes=code)


def _check_prompts(p: ast.Pipeline, m: ast.ModelDef, directory: str, d: Diagnostics) -> None:
    """The first row of a .jsonl/.json data file, for each rollout on model ``m`` (or a copy of
    it) that reads a prompt field of it: AF346 when the field holds chat messages and the
    tokenizer saved in ``directory`` has no chat template; AF348 when the tokenizer cannot
    encode characters of the prompt as the model would see it
    (:func:`asyncflow.modelsrc.spell_back`). Reads files only (no torch, no transformers)."""
    from asyncflow.prompts import round_trip_error
    from asyncflow.modelsrc import TemplateRejects, has_chat_template, spell_back

    no_template = has_chat_template(directory) is False

    def base(name: str | None) -> str | None:
        seen = set()
        while name in p.models and p.models[name].copy_of and name not in seen:
            seen.add(name)
            name = p.models[name].copy_of
        return name

    prompts = {t.inputs[0] for t in p.tasks.values() if rules_of(t.kind).samples and t.inputs
               and t.env is None and capabilities(t.engine, load=False).tokenizes and base(t.model) == m.name}
    for src in p.data.values():
        row = _first_row(p, src) if set(src.fields or ()) & prompts else None
        for i, f in enumerate(src.fields or ()):
            if f not in prompts or row is None or row.get(f) is None:
                continue
            if no_template and is_chat(row[f]):
                d.add("AF346", _at(src, f"fields.{i}"),
                      "give the tokenizer a chat template (tokenizer.chat_template = ...; "
                      "tokenizer.save_pretrained(dir)), or store the prompts as strings",
                      field=f, source=src.name, model=m.name, path=directory)
                continue
            try:
                seen = spell_back(directory, row[f])
            except TemplateRejects as why:
                d.add("AF349", _at(src, f"fields.{i}"),
                      "store the messages in a form the template accepts, or give the tokenizer "
                      "a template that accepts them",
                      field=f, source=src.name, model=m.name, path=directory, why=str(why))
                continue
            e = round_trip_error(*seen) if seen else None
            if e is not None:
                d.add("AF348", _at(src, f"fields.{i}"),
                      "train the tokenizer on those characters (a byte-level BPE: "
                      "initial_alphabet=pre_tokenizers.ByteLevel.alphabet()), or keep them out of "
                      "the data and the chat template",
                      field=f, source=src.name, model=m.name, path=directory, **e.fields)


def _first_row(p: ast.Pipeline, src: ast.DataDef) -> dict | None:
    """The first row of a data source's .jsonl, .json or .parquet file (the last with pyarrow,
    the data extra), or None when it cannot be read cheaply (a factory, another format, a
    broken file: the data checks report those)."""
    import json

    v = src.source
    if not isinstance(v, str) or not v.lower().endswith((".jsonl", ".json", ".parquet")):
        return None
    path = _find_file(p, v)
    if path is None or not path.is_file():
        return None
    if v.lower().endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(str(path)).iter_batches(batch_size=1), None)
            return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
        except Exception:  # noqa: BLE001 -- no pyarrow, or a file the data checks report
            return None
    try:
        with open(path) as f:
            if v.lower().endswith(".jsonl"):
                line = next((ln for ln in f if ln.strip()), None)
                row = json.loads(line) if line else None
            else:
                rows = json.load(f)
                row = rows[0] if isinstance(rows, list) and rows else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def bases(p: ast.Pipeline) -> list[str]:
    """Where relative paths and local modules are looked up, as ``run`` looks: the pipeline's
    directory, the CWD (:func:`asyncflow.refs.search_path`)."""
    return search_path(p.path or None)


def _find_file(p: ast.Pipeline, v: str) -> Path | None:
    return find_file(v, bases(p))


def _where(p: ast.Pipeline, v: str) -> str:
    if Path(v).expanduser().is_absolute():
        return "the file system"
    return " and ".join(str(b) for b in bases(p))


def check_ref(p: ast.Pipeline, ref: str, key: str, loc: SourceLoc, d: Diagnostics) -> None:
    module, _, attr = ref.partition(":")
    spec = find_module(module, bases(p))
    if spec is None:
        d.add("AF340", loc, f"not found on sys.path nor in {_where(p, 'x')}", module=module, key=key,
              ref=ref)
        return
    names = top_level_names(spec)
    top = attr.split(".")[0]
    if names is None or top in names:
        return
    if spec.submodule_search_locations and find_module(f"{module}.{top}", []) is not None:
        return
    if isinstance(names, SyntaxError):
        d.add("AF341", loc, f"the module does not parse (line {names.lineno}: {names.msg})",
              module=module, attr=top, key=key, ref=ref)
        return
    d.add("AF341", loc, did_you_mean(top, [n for n in names if not n.startswith("_")]),
          module=module, attr=top, key=key, ref=ref)


def check_source(p: ast.Pipeline, src: ast.DataDef, d: Diagnostics) -> None:
    """A data source is found as ``run`` reads it (:func:`asyncflow.runtime.data.read_source`):
    a ``module:function``, a directory (``save_to_disk``'s or ``load_dataset``'s), a .jsonl,
    .json or .parquet file, or a hub data set ``org/name[@revision]``; ``split:`` only where the
    source has splits, and one it has where that is cheap to know (AF390)."""
    from asyncflow import datasets

    loc = _at(src, "source")
    v = src.source
    if not isinstance(v, str):
        return
    bad_split = lambda problem, hint=None: d.add("AF390", _at(src, "split"), hint,  # noqa: E731
                                                 source=src.name, problem=problem)
    found = None if REF_RE.match(v) else _find_file(p, v)
    if REF_RE.match(v):
        check_ref(p, v, "source", loc, d)
        if src.split is not None:
            bad_split('split applies to a data set directory or a hub data set; a "module:function" '
                      "source returns its rows (choose them with its args)")
    elif found is not None and found.is_dir():
        _check_data_dir(src, v, found, d, bad_split)
    elif v.lower().endswith(DATA_SUFFIXES):
        if found is None:
            d.add("AF342", loc, key="source", path=v, where=_where(p, v))
        else:
            _check_fields(p, src, found, d)
        if src.split is not None:
            bad_split(f"a {Path(v).suffix} file has no splits (split applies to a data set "
                      "directory or a hub data set): drop it, or keep each split in its own file")
    elif found is None and datasets.HUB_DATA_ID.match(v):
        repo, rev = datasets.HUB_DATA_ID.match(v).group("repo", "rev")
        if datasets.offline() and not datasets.hub_cached(repo, rev):
            caches = " nor ".join(str(c) for c in datasets.hub_caches())
            d.add("AF342", loc, key="source", path=v,
                  where=f"{_where(p, v)}; as a hub data set, not in the Hugging Face cache ({caches}) "
                        "and HF_HUB_OFFLINE is set, so nothing is downloaded")
    elif found is None and ("/" in v or v.startswith((".", "~"))):
        d.add("AF342", loc, key="source", path=v, where=_where(p, v))
    else:
        d.add("AF343", loc, source=src.name, value=v)


def _file_fields(p: ast.Pipeline, src: ast.DataDef, found: Path) -> list[str] | None:
    """The fields a data file's rows have, where that is cheap to know: a .jsonl's or .json's
    first row (every row must have each declared field: ``run`` checks them all, AF603), a
    .parquet file's columns (its schema, read without the rows; only where pyarrow is
    installed). None where it is not known."""
    if str(found).lower().endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:  # the [data] extra is not installed: run reads and checks the rows
            return None
        try:
            return list(pq.read_schema(found).names)
        except (OSError, ValueError):  # a broken file: run reports it (AF601)
            return None
    row = _first_row(p, src)
    return list(row) if row is not None else None


def _check_fields(p: ast.Pipeline, src: ast.DataDef, found: Path, d: Diagnostics) -> None:
    """AF392: a declared field that the data file's rows do not have (as ``run``'s AF603
    would say of row 0), located at the field, with the names the file has."""
    has = _file_fields(p, src, found)
    if has is None:
        return
    for i, f in enumerate(src.fields or ()):
        if f not in has:
            d.add("AF392", _at(src, f"fields.{i}"), did_you_mean(f, has), source=src.name,
                  path=src.source, field=f, has=", ".join(has) or "no fields")


def _check_data_dir(src: ast.DataDef, v: str, found: Path, d: Diagnostics, bad_split) -> None:
    from asyncflow import datasets

    splits = datasets.saved_splits(found)
    if splits is None:  # not save_to_disk's: load_dataset's data files (split names not cheap)
        if not datasets.has_data_files(found):
            d.add("AF391", _at(src, "source"), source=src.name, path=v)
        return
    if src.split is None:
        if len(splits) > 1:
            d.add("AF390", _at(src, "source"), source=src.name,
                  problem=f"'{v}' holds the splits {', '.join(splits)}: say which with `split:`")
        return
    base = src.split.split("[")[0]  # train[:100]: a slice of a split
    if base not in splits:
        has = f"its splits are {', '.join(splits)}" if splits else "it is one data set with no split names"
        bad_split(f"'{v}' has no split '{base}': {has}", did_you_mean(base, splits))


__all__ = ["bases", "check_init", "check_ref", "check_source"]
