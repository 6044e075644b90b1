"""``dcpx inspect CKPT``: what a DCP checkpoint holds, from its metadata
alone (nothing but ``.metadata`` is read)."""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
    TensorStorageMetadata,
)

from ..filesystem import FileSystemReader
from ._common import dtype_name, human

HELP = "list what a checkpoint holds: keys, dtypes, shapes, shards, sizes"


def describe(path: str) -> dict:
    """The checkpoint's contents as plain data (what ``--json`` prints)."""
    reader = FileSystemReader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)   # checks the data files: present, regular, long enough
    files: dict[str, int] = defaultdict(int)
    for info in md.storage_data.values():
        files[info.relative_path] += info.length
    keys = {}
    tensor_bytes = 0
    for key, v in sorted(md.state_dict_metadata.items()):
        if isinstance(v, TensorStorageMetadata):
            nbytes = v.size.numel() * v.properties.dtype.itemsize
            tensor_bytes += nbytes
            shards = []
            for ch in v.chunks:
                info = md.storage_data.get(MetadataIndex(key, ch.offsets))
                shards.append({"offsets": list(ch.offsets), "sizes": list(ch.sizes),
                               "file": info.relative_path if info else None,
                               "offset": info.offset if info else None,
                               "length": info.length if info else None})
            keys[key] = {"type": "tensor", "dtype": dtype_name(v.properties.dtype),
                         "shape": list(v.size), "nbytes": nbytes, "shards": shards}
        else:
            info = md.storage_data.get(MetadataIndex(key))
            keys[key] = {"type": "value", "file": info.relative_path if info else None,
                         "length": info.length if info else None}
    return {"path": str(path), "version": md.version,
            "tensors": sum(1 for k in keys.values() if k["type"] == "tensor"),
            "values": sum(1 for k in keys.values() if k["type"] == "value"),
            "tensor_bytes": tensor_bytes,
            "files": dict(sorted(files.items())), "keys": keys}


def inspect_checkpoint(path: str, limit: int, out=None, as_json: bool = False) -> int:
    out = out or sys.stdout  # looked up per call: redirect_stdout works
    d = describe(path)
    if as_json:
        json.dump(d, out, indent=1)
        print(file=out)
        return 0
    print(f"checkpoint {path}", file=out)
    print(f"  version {d['version']}, {d['tensors']} tensors ({human(d['tensor_bytes'])}), "
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
            print(f"  {key}: {v['dtype']}{v['shape']}{chunks}", file=out)
        else:
            print(f"  {key}: (pickled value)", file=out)
        shown += 1
    return 0


def add_parser(sub, **common) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP + ".", **common)
    p.add_argument("checkpoint")
    p.add_argument("--limit", type=int, default=50, help="keys to list (default 50)")
    p.add_argument("--json", action="store_true",
                   help="print everything (every key, its shards: offsets, sizes, file, "
                        "extent; every data file's size) as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    return inspect_checkpoint(args.checkpoint, args.limit, as_json=args.json)
