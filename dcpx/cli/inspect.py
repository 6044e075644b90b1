"""``dcpx inspect CKPT``: what a DCP checkpoint holds, from its metadata,
and its non-tensor values (step counters, hyperparameters, strings, ...)
unpickled with dcpx's safe unpickler (the allow-list: looking never runs
code from the checkpoint).  Tensor data is not read (``dcpx verify`` reads
and CRC-checks every record).

A damaged checkpoint shows what can be read and each problem found: a
corrupt ``.metadata`` (then the data files present are listed), a key with
no storage entry, a missing or truncated data file, a value that does not
unpickle or is refused by the allow-list."""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

from ._common import dtype_name, human
from ._show import SHOW_MAX, json_value, text, text_cut

HELP = "list what a checkpoint holds: keys, dtypes, shapes, shards, sizes, values"

#: values whose record is larger are not read (their size is shown)
VALUE_READ_MAX = 1 << 20
#: characters of a value's text in the listing (--json: _show.SHOW_MAX)
REPR_MAX = 100


def _value_entry(reader, key: str, info, read: bool,
                 show_max: int = SHOW_MAX) -> tuple[dict, str]:
    """(JSON entry of a non-tensor value, error or ""): the value itself
    when it is JSON as it is within ``show_max`` characters, else its text
    (``_show.text``: at most ``show_max`` characters, ``truncated`` when
    cut)."""
    out: dict[str, Any] = {"type": "value", "file": info.relative_path if info else None,
                           "length": info.length if info else None}
    if info is None or not read:
        return out, ""
    if info.length > VALUE_READ_MAX:
        out["not_read"] = f"record of {human(info.length)} (over {human(VALUE_READ_MAX)})"
        return out, ""
    from ..formats.transforms import InflatesTooFar
    try:
        # CRC-checked, allow-list unpickler; a compressed record inflated to
        # VALUE_READ_MAX bytes at most
        v = reader.load_value(key, info, limit=VALUE_READ_MAX)
    except InflatesTooFar:
        out["not_read"] = f"record inflates past {human(VALUE_READ_MAX)}"
        return out, ""
    except Exception as e:
        msg = str(e) or type(e).__name__
        out["error"] = msg
        return out, msg
    out["value_type"] = type(v).__module__ + "." + type(v).__qualname__ \
        if type(v).__module__ != "builtins" else type(v).__name__
    if json_value(v, show_max):
        out["value"] = v
    else:
        out["repr"], cut = text_cut(v, show_max)
        if cut:
            out["truncated"] = True
    return out, ""


def describe(path: str, *, values: Any = True, show_max: int = SHOW_MAX) -> dict:
    """The checkpoint's contents as plain data (what ``--json`` prints).

    ``values``: read the non-tensor values (True: all; N: those among the
    first N keys in sorted order, the ones a listing shows; False: none).  ``problems`` lists what is damaged, one
    ``{"key", "error"}`` each (``.metadata`` for the metadata itself); the
    rest is described as far as it can be read.  Raises only when there is
    no checkpoint at all (no directory, no ``.metadata``)."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from ..errors import IncompleteCheckpointError
    from ..filesystem import FileSystemReader

    reader = FileSystemReader(path)
    problems: list[dict] = []
    try:
        md = reader.read_metadata()
    except (IncompleteCheckpointError, NotADirectoryError, FileNotFoundError):
        raise
    except Exception as e:       # corrupt, unsafe or unreadable .metadata
        problems.append({"key": ".metadata", "error": str(e) or type(e).__name__})
        files = {}
        for name in sorted(os.listdir(reader.path)):
            p = reader.path / name
            if name != ".metadata" and os.path.isfile(p) and not os.path.islink(p):
                files[name] = os.path.getsize(p)
        return {"path": str(path), "version": None, "tensors": 0, "values": 0,
                "tensor_bytes": 0, "files": files, "keys": {}, "problems": problems}

    bad: dict[Any, str] = {}
    for index, e in reader.check_storage(md):      # missing / short files, bad extents
        bad[index] = str(e) or type(e).__name__
    good = {i: info for i, info in md.storage_data.items() if i not in bad}
    reader.set_up_storage_reader(
        Metadata(state_dict_metadata=md.state_dict_metadata, storage_data=good,
                 planner_data=md.planner_data, storage_meta=md.storage_meta), True)

    files: dict[str, int] = defaultdict(int)
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            files[rel] += getattr(info, "length", 0) if isinstance(
                getattr(info, "length", 0), int) else 0
    keys = {}
    tensor_bytes = 0
    for n, (key, v) in enumerate(sorted(md.state_dict_metadata.items())):
        if isinstance(v, TensorStorageMetadata):
            nbytes = v.size.numel() * v.properties.dtype.itemsize
            tensor_bytes += nbytes
            shards, errors = [], []
            for ch in v.chunks:
                index = MetadataIndex(key, ch.offsets)
                info = md.storage_data.get(index)
                shards.append({"offsets": list(ch.offsets), "sizes": list(ch.sizes),
                               "file": info.relative_path if info else None,
                               "offset": info.offset if info else None,
                               "length": info.length if info else None})
                if info is None:
                    errors.append(f"{reader.path}: metadata has no storage entry for "
                                  f"{key!r} at offset {tuple(ch.offsets)}")
                elif index in bad:
                    errors.append(bad[index])
            entry = {"type": "tensor", "dtype": dtype_name(v.properties.dtype),
                     "shape": list(v.size), "nbytes": nbytes, "shards": shards}
        else:
            index = MetadataIndex(key)
            info = md.storage_data.get(index)
            errors = []
            if info is None:
                errors.append(f"{reader.path}: metadata has no storage entry for {key!r}")
            elif index in bad:
                errors.append(bad[index])
            read = not errors and (values is True or (values is not False and n < values))
            entry, error = _value_entry(reader, key, info, read, show_max)
            if error:
                errors.append(error)
        if errors:
            entry["damaged"] = True
            problems.extend({"key": key, "error": e} for e in errors)
        keys[key] = entry
    # torch <= 2.8's Metadata has no version (and older checkpoints none set)
    return {"path": str(path), "version": getattr(md, "version", None),
            "tensors": sum(1 for k in keys.values() if k["type"] == "tensor"),
            "values": sum(1 for k in keys.values() if k["type"] == "value"),
            "tensor_bytes": tensor_bytes,
            "files": dict(sorted(files.items())), "keys": keys, "problems": problems}


def _short(text: str, n: int = REPR_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _value_text(v: dict) -> str:
    if v.get("damaged"):
        return "value (damaged, see below)"
    if "not_read" in v:
        return f"value, {v['not_read']}: not read"
    if "value_type" not in v:
        return "value"
    shown = text(v["value"], 4 * REPR_MAX) if "value" in v else v["repr"]
    return f"{v['value_type']} {_short(shown)}"


def inspect_checkpoint(path: str, limit: int, out=None, as_json: bool = False) -> int:
    """Print the description; 0 when nothing is damaged, else 1 (each
    problem listed; the summary also on stderr)."""
    out = out or sys.stdout  # looked up per call: redirect_stdout works
    if as_json:
        d = describe(path)
        json.dump(d, out, indent=1, allow_nan=False)
        print(file=out)
    else:
        d = describe(path, values=max(limit, 0), show_max=4 * REPR_MAX)
        _print_text(d, path, limit, out)
    if d["problems"]:
        print(f"dcpx inspect: {path}: {len(d['problems'])} problem(s) found "
              f"(dcpx verify also reads and checks every tensor record)", file=sys.stderr)
        return 1
    return 0


def _print_text(d: dict, path: str, limit: int, out) -> None:
    print(f"checkpoint {path}", file=out)
    if any(p["key"] == ".metadata" for p in d["problems"]):
        print(f"  .metadata unreadable; {len(d['files'])} other files "
              f"({human(sum(d['files'].values()))})", file=out)
        for name, n in d["files"].items():
            print(f"  {name}: {human(n)}", file=out)
    else:
        version = "none recorded" if d["version"] is None else d["version"]
        print(f"  version {version}, {d['tensors']} tensors ({human(d['tensor_bytes'])}), "
              f"{d['values']} other values, "
              f"{len(d['files'])} data files ({human(sum(d['files'].values()))})", file=out)
    shown = 0
    for key, v in d["keys"].items():
        if shown == limit:
            print(f"  ... {len(d['keys']) - limit} more (use --limit)", file=out)
            break
        if v["type"] == "tensor":
            n = len(v["shards"])
            chunks = f", {n} chunks" if n != 1 else ""
            damaged = " (damaged, see below)" if v.get("damaged") else ""
            print(f"  {key}: {v['dtype']}{v['shape']}{chunks}{damaged}", file=out)
        else:
            print(f"  {key}: {_value_text(v)}", file=out)
        shown += 1
    for p in d["problems"]:
        print(f"  BAD {p['key']}: {p['error']}", file=out)


def add_parser(sub, **common) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP + ".", **common)
    p.add_argument("checkpoint")
    p.add_argument("--limit", type=int, default=50, help="keys to list (default 50)")
    p.add_argument("--json", action="store_true",
                   help="print everything (every key, its shards: offsets, sizes, file, "
                        "extent; every value; every data file's size; the problems found) "
                        "as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    return inspect_checkpoint(args.checkpoint, args.limit, as_json=args.json)
