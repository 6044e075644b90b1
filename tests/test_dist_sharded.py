"""Sharded state across 4 ranks (issue #4, part 2): what a distributed save
writes.

One spawn of 4 ranks saves one state dict with ``dcpx.save`` (and the same
with torch's ``dcp.save``, as the reference) holding DTensors on a 1-D mesh
(Shard(0), Shard(1), Replicate, uneven shards: 7 and 3 rows over 4 ranks,
an empty tensor, a 0-d tensor) and on a 2-D (2, 2) mesh ([Shard(0),
Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)]), plain tensors
(identical on every rank) and non-tensor values (int, list, nested dict).

Then, one pytest test per check:

* the chunks (global offsets and sizes) in ``.metadata`` are the expected
  ones, and torch's own save records the same;
* every chunk and every non-tensor value is written exactly once: one
  storage entry each, as many records in the data files as entries, and the
  data files no larger than the referenced records (a replicated 64 KiB
  tensor written by every rank cannot hide);
* each rank writes its own shard (into its own ``__{rank}_*`` data file),
  and every record holds exactly the bytes of its chunk of the global value
  (read with torch.load, not dcpx);
* it loads back bit-exactly into the same layout with dcpx and with torch,
  and dcpx loads torch's checkpoint;
* ``async_save`` (per-call staging, and a long-lived ``DefaultStager``) of
  the same state writes the same chunks, each once, with the values of the
  call although the caller zeroes its tensors right after staging;
* in the pytest process (no process group) it loads into plain full tensors.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

import dcpx
from conftest import assert_bit_equal
from dist_helpers import (
    CheckSession,
    chunk_of,
    chunk_table,
    count_archives,
    data_file_bytes,
    dtensor_of,
    full_value,
    read_metadata,
    record_tensor,
    storage_entries,
)

pytestmark = pytest.mark.dist

WORLD = 4

# name -> (global shape, dtype, mesh ("1d": (4,), "2d": (2, 2)), placements
# as strings), and the chunks ((offsets), (sizes)) the save must record.
LAYOUT = {
    "s0": ((8, 6), torch.float32, "1d", ["S0"]),
    "s1": ((5, 8), torch.bfloat16, "1d", ["S1"]),
    "uneven7": ((7, 3), torch.int64, "1d", ["S0"]),
    "uneven3": ((3, 4), torch.float32, "1d", ["S0"]),
    "rep": ((128, 128), torch.float32, "1d", ["R"]),
    "scalar": ((), torch.float32, "1d", ["R"]),
    "empty": ((0, 5), torch.float32, "1d", ["S0"]),
    "m_s0_r": ((6, 4), torch.float64, "2d", ["S0", "R"]),
    "m_r_s1": ((4, 10), torch.float32, "2d", ["R", "S1"]),
    "m_s0_s1": ((4, 6), torch.float16, "2d", ["S0", "S1"]),
}
PLAIN = {"plain": ((128, 64), torch.float32), "plain0d": ((), torch.int64)}
NON_TENSOR = {"step": 42, "hist": [1, 2.5, "x"], "cfg": {"lr": 0.1, "name": "adam"}}
BYTES_KEYS = {"step", "hist", "cfg.lr", "cfg.name"}

EXPECTED_CHUNKS = {
    "s0": [((2 * r, 0), (2, 6)) for r in range(4)],
    "s1": [((0, 2 * r), (5, 2)) for r in range(4)],
    "uneven7": [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (1, 3))],
    "rep": [((0, 0), (128, 128))],
    "scalar": [((), ())],
    "m_s0_r": [((0, 0), (3, 4)), ((3, 0), (3, 4))],
    "m_r_s1": [((0, 0), (4, 5)), ((0, 5), (4, 5))],
    "m_s0_s1": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],
    "plain": [((0, 0), (128, 64))],
    "plain0d": [((), ())],
}
# "uneven3" (3 rows over 4 ranks: one rank's shard is empty) and "empty"
# (0 rows): the non-empty chunks are fixed; whether an empty chunk is
# listed is torch's choice, so those two are compared with torch's save.
NONEMPTY_CHUNKS = {"uneven3": [((0, 0), (1, 4)), ((1, 0), (1, 4)), ((2, 0), (1, 4))],
                   "empty": []}

# 1-D-mesh keys sharded along a dim: rank r's shard is the r-th chunk.
OWN_SHARD = {"s0": lambda r: (2 * r, 0), "s1": lambda r: (0, 2 * r),
             "uneven7": lambda r: (2 * r, 0)}


def full_of(name: str) -> torch.Tensor:
    shape, dtype = (LAYOUT[name][:2] if name in LAYOUT else PLAIN[name])
    return full_value(name, shape, dtype)


def _placements(spec):
    from dtensor_api import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def build_state(zeros: bool = False) -> dict:
    """The state dict (every rank builds the same global values)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (WORLD,)),
              "2d": init_device_mesh("cpu", (2, 2))}
    sd: dict = {}
    for name, (shape, dtype, mesh, spec) in LAYOUT.items():
        full = torch.zeros(shape, dtype=dtype) if zeros else full_of(name)
        sd[name] = dtensor_of(full, meshes[mesh], _placements(spec))
    for name in PLAIN:
        sd[name] = torch.zeros_like(full_of(name)) if zeros else full_of(name)
    if zeros:
        sd.update({"step": None, "hist": None, "cfg": {"lr": None, "name": None}})
    else:
        sd.update(pickle.loads(pickle.dumps(NON_TENSOR)))
    return sd


def assert_state_matches(sd: dict, what: str) -> None:
    """Local shards bit-exact against the expected layout, full_tensor()
    bit-exact against the global value, non-tensor values equal."""
    from dtensor_api import DTensor

    expected = build_state()
    for name in LAYOUT:
        got, exp = sd[name], expected[name]
        assert isinstance(got, DTensor), f"{what}: {name} is no longer a DTensor: {type(got)}"
        assert got.placements == exp.placements, f"{what}: {name}: placements changed"
        assert_bit_equal(got.to_local(), exp.to_local(), f"{what}: local shard of {name}")
        assert_bit_equal(got.full_tensor(), full_of(name), f"{what}: full_tensor() of {name}")
    for name in PLAIN:
        assert_bit_equal(sd[name], full_of(name), f"{what}: {name}")
    for key, value in NON_TENSOR.items():
        assert sd[key] == value, f"{what}: {key}: {sd[key]!r} != {value!r}"


# --------------------------------------------------------------------------
# checks, run in order on every rank of one 4-rank spawn


def check_save(ctx):
    """dcpx.save and torch's dcp.save of the same state; dcpx's returned
    Metadata is kept for the next check."""
    import torch.distributed.checkpoint as tdcp

    sd = build_state()
    md = dcpx.save(sd, checkpoint_id=ctx.path("dcpx"))
    assert md is not None, "dcpx.save returned None instead of the Metadata"
    with open(ctx.path(f"returned_md.{ctx.rank}.pkl"), "wb") as f:
        pickle.dump(md, f)  # a plain Metadata once unpickled, whatever save returned
    tdcp.save(build_state(), checkpoint_id=ctx.path("torch"))


def check_returned_metadata_is_the_committed_one(ctx):
    """Every rank's dcpx.save returned the Metadata that was committed."""
    on_disk = read_metadata(ctx.path("dcpx"))
    with open(ctx.path(f"returned_md.{ctx.rank}.pkl"), "rb") as f:
        returned = pickle.load(f)
    assert isinstance(returned, dcpx.Metadata), type(returned)
    assert set(vars(returned)) == set(vars(on_disk))  # (no version before torch 2.9)
    for field in ("state_dict_metadata", "storage_data", "planner_data", "version"):
        got, exp = getattr(returned, field, None), getattr(on_disk, field, None)
        assert got == exp, (f"rank {ctx.rank}: the Metadata dcpx.save returned differs from "
                            f".metadata in {field}: {got} != {exp}")


def check_chunk_offsets_and_sizes(ctx):
    """.metadata lists each tensor's global shards with global offsets."""
    if ctx.rank != 0:
        return
    md = read_metadata(ctx.path("dcpx"))
    ref = read_metadata(ctx.path("torch"))
    table = chunk_table(md)
    expected_keys = set(LAYOUT) | set(PLAIN)
    assert set(table) == expected_keys, f"tensor keys {sorted(table)} != {sorted(expected_keys)}"
    bytes_keys = set(md.state_dict_metadata) - set(table)
    assert bytes_keys == BYTES_KEYS, f"non-tensor keys {sorted(bytes_keys)} != {sorted(BYTES_KEYS)}"
    for name, chunks in EXPECTED_CHUNKS.items():
        assert table[name] == sorted(chunks), f"{name}: chunks {table[name]} != {sorted(chunks)}"
    for name, chunks in NONEMPTY_CHUNKS.items():
        nonempty = [c for c in table[name] if all(c[1]) or not c[1]]
        assert nonempty == chunks, f"{name}: non-empty chunks {nonempty} != {chunks}"
    for name in expected_keys:
        tmd = md.state_dict_metadata[name]
        shape, dtype = (LAYOUT[name][:2] if name in LAYOUT else PLAIN[name])
        assert tuple(tmd.size) == shape, f"{name}: global size {tuple(tmd.size)} != {shape}"
        assert tmd.properties.dtype == dtype, f"{name}: dtype {tmd.properties.dtype} != {dtype}"
    ref_table = chunk_table(ref)
    diff = {k: (table.get(k), ref_table.get(k)) for k in set(table) | set(ref_table)
            if table.get(k) != ref_table.get(k)}
    assert not diff, f"chunks differ from torch's save of the same state (dcpx, torch): {diff}"


def check_each_value_written_once(ctx):
    """One storage entry per chunk and per non-tensor value, and nothing
    else in the data files: replicated DTensors and plain tensors (the same
    on all 4 ranks) are written once, not once per rank."""
    if ctx.rank == 0:
        assert_written_once(ctx.path("dcpx"))


def assert_written_once(path: str) -> None:
    md = read_metadata(path)
    entries = storage_entries(md)
    want = sorted([(name, offs) for name, chunks in chunk_table(md).items()
                   for offs, _ in chunks] + [(k, None) for k in BYTES_KEYS],
                  key=lambda e: (e[0], e[1] or ()))
    got = [(e[0], e[1]) for e in entries]
    assert got == want, f"storage entries {got} != one per chunk / value {want}"
    records = count_archives(path)
    assert records == len(entries), (
        f"the data files hold {records} records for {len(entries)} storage entries "
        f"(something was written more than once)")
    files = data_file_bytes(path)
    referenced = sum(e[4] for e in entries)
    total = sum(files.values())
    # dcpx aligns records to 64 bytes; anything beyond that is unreferenced data.
    slack = 64 * len(entries) + 4096 * len(files)
    assert referenced <= total <= referenced + slack, (
        f"data files hold {total} bytes for {referenced} referenced bytes "
        f"(files: {files}); the 64 KiB replicated tensor 'rep' and the 32 KiB plain "
        f"tensor must be written once")
    for e in entries:
        assert e[2] in files, f"{e[0]}: stored in {e[2]}, which is not a data file here"


def check_each_rank_writes_its_own_shard(ctx):
    """Rank r's shard of a 1-D sharded tensor lives in rank r's data file,
    i.e. it was written by rank r and not gathered elsewhere."""
    if ctx.rank != 0:
        return
    md = read_metadata(ctx.path("dcpx"))
    where = {(e[0], e[1]): e[2] for e in storage_entries(md)}
    for name, offset_of in OWN_SHARD.items():
        for r in range(WORLD):
            rel = where.get((name, offset_of(r)))
            assert rel is not None, f"{name}: no storage entry for rank {r}'s shard"
            assert rel.startswith(f"__{r}_"), (
                f"{name}: rank {r}'s shard at offset {offset_of(r)} is in {rel}, not in "
                f"one of rank {r}'s files (__{r}_*.distcp)")


def check_records_hold_their_chunks(ctx):
    """Every record, read with torch.load, holds exactly its chunk of the
    global value (bit-exact), and non-tensor records their values."""
    if ctx.rank == 0:
        assert_records_hold_their_chunks(ctx.path("dcpx"))


def assert_records_hold_their_chunks(path: str) -> None:
    import io

    md = read_metadata(path)
    flat_values = {"step": 42, "hist": [1, 2.5, "x"], "cfg.lr": 0.1, "cfg.name": "adam"}
    for fqn, offs, rel, off, length in storage_entries(md):
        if offs is None:
            with open(os.path.join(path, rel), "rb") as f:
                f.seek(off)
                value = torch.load(io.BytesIO(f.read(length)), weights_only=True)
            assert value == flat_values[fqn], f"{fqn}: record holds {value!r}"
            continue
        sizes = dict((tuple(c.offsets), tuple(c.sizes))
                     for c in md.state_dict_metadata[fqn].chunks)[offs]
        t = record_tensor(path, rel, off, length)
        assert_bit_equal(t, chunk_of(full_of(fqn), offs, sizes).contiguous(),
                         f"record of {fqn} at offset {offs}")


def check_dcpx_load_same_layout(ctx):
    sd = build_state(zeros=True)
    dcpx.load(sd, checkpoint_id=ctx.path("dcpx"))
    assert_state_matches(sd, "dcpx.load of dcpx's checkpoint")


def check_torch_loads_dcpx_checkpoint(ctx):
    import torch.distributed.checkpoint as tdcp

    sd = build_state(zeros=True)
    tdcp.load(sd, checkpoint_id=ctx.path("dcpx"))
    assert_state_matches(sd, "torch's dcp.load of dcpx's checkpoint")


def check_dcpx_loads_torch_checkpoint(ctx):
    sd = build_state(zeros=True)
    dcpx.load(sd, checkpoint_id=ctx.path("torch"))
    assert_state_matches(sd, "dcpx.load of torch's checkpoint")


def check_async_save(ctx):
    """async_save of the same state: a Future (per-call staging) and an
    AsyncSaveResponse from a long-lived DefaultStager, whose staged DTensors
    are the local shards; the caller zeroes every tensor as soon as staging
    is done.  Same chunks as the sync save, each value once, each record
    holding its chunk, and it loads back bit-exactly."""
    sync_chunks = chunk_table(read_metadata(ctx.path("dcpx")))
    with dcpx.DefaultStager() as stager:
        for variant, st in (("future", None), ("stager", stager), ("stager_again", stager)):
            sd = build_state()
            path = ctx.path(f"async_{variant}")
            ret = dcpx.async_save(sd, checkpoint_id=path, async_stager=st)
            if isinstance(ret, dcpx.AsyncSaveResponse):
                ret.staging_completion.result(timeout=60)
                ret = ret.upload_completion
            for v in sd.values():
                if isinstance(v, torch.Tensor):
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
            ret.result(timeout=60)
            assert os.path.exists(os.path.join(path, ".metadata")), f"{variant}: not committed"
            if ctx.rank == 0:
                got = chunk_table(read_metadata(path))
                assert got == sync_chunks, f"{variant}: chunks {got} != sync save's {sync_chunks}"
                assert_written_once(path)
                assert_records_hold_their_chunks(path)
            loaded = build_state(zeros=True)
            dcpx.load(loaded, checkpoint_id=path)
            assert_state_matches(loaded, f"async_save ({variant})")
        assert stager.alloc_count == 1, f"{stager.alloc_count} staging buffers for one structure"


CHECKS = [check_save, check_returned_metadata_is_the_committed_one,
          check_chunk_offsets_and_sizes, check_each_value_written_once,
          check_each_rank_writes_its_own_shard, check_records_hold_their_chunks,
          check_dcpx_load_same_layout, check_torch_loads_dcpx_checkpoint,
          check_dcpx_loads_torch_checkpoint, check_async_save]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(WORLD, CHECKS, tmp_path_factory.mktemp("sharded")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_sharded_4_ranks(session, check):
    session.assert_ok(check)


def test_sharded_checkpoint_loads_into_plain_tensors_without_process_group(session):
    """In this (pytest) process, no process group: the 4-rank checkpoint
    loads into plain full tensors, bit-exactly."""
    session.assert_ok("check_save")
    sd = {name: torch.zeros_like(full_of(name)) for name in list(LAYOUT) + list(PLAIN)}
    sd.update({"step": None, "hist": None, "cfg": {"lr": None, "name": None}})
    dcpx.load(sd, checkpoint_id=session.workdir / "dcpx")
    for name in list(LAYOUT) + list(PLAIN):
        assert_bit_equal(sd[name], full_of(name), name)
    for key, value in NON_TENSOR.items():
        assert sd[key] == value, key
