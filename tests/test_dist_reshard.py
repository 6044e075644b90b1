"""Load-time resharding (issue #4, part 3) and interop with torch at another
world size (part 5).

Save phase, one spawn per N in {1, 2, 4}: the same global state (DTensors
on a 1-D mesh of N ranks: Shard(0), Shard(1), uneven shards (5 rows),
Replicate, an empty tensor; a plain tensor, a 0-d tensor and non-tensor
values) is saved by ``dcpx.save`` (``dcpx_N``) and by torch's ``dcp.save``
(``torch_N``); with N = 4 also on a (2, 2) mesh (``dcpx_4_2d``), and a
tensor saved as 12 interleaved chunks (a ShardedTensor with 3 shards per
rank, ``many_4``), which loads through dcpx's sorted chunk index.

Load phase, one spawn per M in {1, 2, 4}, one check (and pytest test) per
saved checkpoint and kind of load, so all 9 (N, M) pairs are covered:

* ``dcpx.load`` of ``dcpx_N`` into the same placements on M ranks;
* into other placements (Shard(0) -> Shard(1), Shard(1) -> Shard(0),
  Shard -> Replicate, Replicate -> Shard);
* into plain full tensors on every rank;
* with M = 4, into a (2, 2) mesh (1-D mesh -> 2-D mesh), and ``dcpx_4_2d``
  into a 1-D mesh at every M (2-D -> 1-D);
* ``many_4`` into Shard(0), Shard(1), Replicate and plain tensors;
* interop: torch's ``dcp.load`` of ``dcpx_N`` and ``dcpx.load`` of
  ``torch_N`` at M ranks;
* and, in the pytest process without a process group, every checkpoint
  into plain full tensors.

Every value is compared bit-exactly: each rank's local shard against the
expected one, and ``full_tensor()`` against the global value.
"""
from __future__ import annotations

import pytest
import torch

import dcpx
from conftest import assert_bit_equal
from dist_helpers import CheckSession, dtensor_of, full_value

pytestmark = pytest.mark.dist

SIZES = (1, 2, 4)

# name -> (global shape, dtype); plain tensors and non-tensor values below.
TENSORS = {
    "a": ((12, 8), torch.float32),
    "b": ((6, 10), torch.bfloat16),
    "c": ((5, 3), torch.float64),   # 5 rows: uneven over 2 and 4 ranks
    "r": ((4, 4), torch.float32),
    "e": ((0, 4), torch.float32),
}
PLAIN = {"p": ((3, 5), torch.int32), "s": ((), torch.float32)}
NON_TENSOR = {"meta": {"step": 100, "names": ["x", "y"]}}

# Placements per layout, on a 1-D mesh ("S0", "S1", "R") or a 2-D mesh.
SAME = {"a": ["S0"], "b": ["S1"], "c": ["S0"], "r": ["R"], "e": ["S0"]}
SWAPPED = {"a": ["S1"], "b": ["S0"], "c": ["R"], "r": ["S0"], "e": ["R"]}
MESH_2D = {"a": ["S0", "S1"], "b": ["R", "S0"], "c": ["S1", "R"], "r": ["S0", "S0"],
           "e": ["R", "R"]}


def full_of(name: str) -> torch.Tensor:
    shape, dtype = TENSORS.get(name) or PLAIN[name]
    return full_value(f"reshard.{name}", shape, dtype)


def _placements(spec):
    from dtensor_api import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def _mesh(ndim: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,) if ndim == 1 else (2, world // 2))


def build_state(layout: dict, zeros: bool = False) -> dict:
    ndim = len(next(iter(layout.values())))
    mesh = _mesh(ndim)
    sd: dict = {}
    for name, (shape, dtype) in TENSORS.items():
        full = torch.zeros(shape, dtype=dtype) if zeros else full_of(name)
        sd[name] = dtensor_of(full, mesh, _placements(layout[name]))
    for name, (shape, dtype) in PLAIN.items():
        sd[name] = torch.zeros(shape, dtype=dtype) if zeros else full_of(name)
    sd["meta"] = ({"step": None, "names": None} if zeros
                  else {"step": 100, "names": ["x", "y"]})
    return sd


def assert_loaded(sd: dict, layout: dict, what: str) -> None:
    expected = build_state(layout)
    for name in TENSORS:
        got, exp = sd[name], expected[name]
        assert tuple(got.placements) == tuple(exp.placements), f"{what}: {name}: placements"
        assert_bit_equal(got.to_local(), exp.to_local(),
                         f"{what}: {name}: local shard ({layout[name]})")
        assert_bit_equal(got.full_tensor(), full_of(name), f"{what}: {name}: full_tensor()")
    for name in PLAIN:
        assert_bit_equal(sd[name], full_of(name), f"{what}: {name}")
    assert sd["meta"] == NON_TENSOR["meta"], f"{what}: meta: {sd['meta']!r}"


# --------------------------------------------------------------------------
# checks: module-level functions (the ranks look them up by name)


MANY_BLOCKS, MANY_SHAPE = 12, (24, 6)


def many_full() -> torch.Tensor:
    return full_value("reshard.many", MANY_SHAPE, torch.float32)


def many_chunks_state(rank: int, world: int) -> dict:
    """A tensor saved as 12 chunks of 2 rows, rank r holding blocks r, r+N,
    r+2N, ... (a ShardedTensor: several shards per rank), so that a load
    goes through dcpx's sorted chunk index (keys with more than 8 chunks),
    with each rank's chunks interleaved with the others'."""
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    full = many_full()
    rows = MANY_SHAPE[0] // MANY_BLOCKS
    shards = [STShard(full[b * rows:(b + 1) * rows].clone(),
                      ShardMetadata([b * rows, 0], [rows, MANY_SHAPE[1]], f"rank:{rank}/cpu"))
              for b in range(rank, MANY_BLOCKS, world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"many": init_from_local_shards(shards, list(MANY_SHAPE))}


def check_save(ctx):
    import torch.distributed.checkpoint as tdcp

    n = ctx.world_size
    dcpx.save(build_state(SAME), checkpoint_id=ctx.path(f"dcpx_{n}"))
    tdcp.save(build_state(SAME), checkpoint_id=ctx.path(f"torch_{n}"))
    if n == 4:
        dcpx.save(build_state(MESH_2D), checkpoint_id=ctx.path("dcpx_4_2d"))
        dcpx.save(many_chunks_state(ctx.rank, n), checkpoint_id=ctx.path("many_4"))


def _define(name: str, fn):
    fn.__name__ = fn.__qualname__ = name
    globals()[name] = fn
    return fn


def _load_check(source: str, layout: dict, loader: str):
    def check(ctx):
        import torch.distributed.checkpoint as tdcp

        sd = build_state(layout, zeros=True)
        (dcpx.load if loader == "dcpx" else tdcp.load)(sd, checkpoint_id=ctx.path(source))
        assert_loaded(sd, layout, f"{loader} load of {source} at world size {ctx.world_size}")
    return check


CHECK_SOURCE_N: dict = {"check_dcpx_4_2d_into_1d_mesh": 4, "check_many_chunks_4": 4}


def _plain_check(source: str):
    def check(ctx):
        """Plain (full) tensors on every rank of a process group."""
        sd = {name: torch.zeros(shape, dtype=dtype)
              for name, (shape, dtype) in list(TENSORS.items()) + list(PLAIN.items())}
        sd["meta"] = {"step": None, "names": None}
        dcpx.load(sd, checkpoint_id=ctx.path(source))
        for name in list(TENSORS) + list(PLAIN):
            assert_bit_equal(sd[name], full_of(name),
                             f"{source} into a plain tensor at world size {ctx.world_size}: {name}")
        assert sd["meta"] == NON_TENSOR["meta"]
    return check


def check_many_chunks_4(ctx):
    """The 12-chunk checkpoint into Shard(0), Shard(1), Replicate and plain."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dist_helpers import read_metadata

    md = read_metadata(ctx.path("many_4")).state_dict_metadata["many"]
    assert isinstance(md, TensorStorageMetadata) and len(md.chunks) == MANY_BLOCKS, (
        f"test setup: expected {MANY_BLOCKS} saved chunks, got {md}")
    mesh = _mesh(1)
    for spec in (["S0"], ["S1"], ["R"]):
        sd = {"many": dtensor_of(torch.zeros(MANY_SHAPE), mesh, _placements(spec))}
        dcpx.load(sd, checkpoint_id=ctx.path("many_4"))
        exp = dtensor_of(many_full(), mesh, _placements(spec))
        assert_bit_equal(sd["many"].to_local(), exp.to_local(), f"many into {spec}: local")
        assert_bit_equal(sd["many"].full_tensor(), many_full(), f"many into {spec}: full")
    sd = {"many": torch.zeros(MANY_SHAPE)}
    dcpx.load(sd, checkpoint_id=ctx.path("many_4"))
    assert_bit_equal(sd["many"], many_full(), "many into a plain tensor")


#: each saved tensor loaded into another dtype (torch casts with copy_)
CAST = {"a": torch.bfloat16, "b": torch.float32, "c": torch.float16, "r": torch.int32,
        "e": torch.float64, "p": torch.float64, "s": torch.bfloat16}


def _cast_check(source: str):
    def check(ctx):
        """Resharded into other placements and other dtypes: dcpx's reads
        (narrowed chunks, cast) against torch's load, bit for bit."""
        import torch.distributed.checkpoint as tdcp

        mesh = _mesh(1)

        def dest():
            sd = {n: dtensor_of(torch.zeros(shape, dtype=CAST[n]), mesh, _placements(SWAPPED[n]))
                  for n, (shape, _) in TENSORS.items()}
            sd.update({n: torch.zeros(shape, dtype=CAST[n]) for n, (shape, _) in PLAIN.items()})
            return sd
        got, expected = dest(), dest()
        dcpx.load(got, checkpoint_id=ctx.path(source))
        tdcp.load(expected, checkpoint_id=ctx.path(source))
        for n in got:
            g, e = got[n], expected[n]
            if n in TENSORS:
                g, e = g.to_local(), e.to_local()
            assert_bit_equal(g, e, f"{source} into {CAST[n]} at world size {ctx.world_size}: {n}")
    return check


def load_checks(m: int) -> list:
    """The checks of the load phase at world size m, in order."""
    checks = []
    for n in SIZES:
        for kind in ("same_placements", "other_placements", "into_2d_mesh",
                     "into_plain_tensors"):
            CHECK_SOURCE_N[f"check_dcpx_{n}_{kind}"] = n
        CHECK_SOURCE_N[f"check_torch_loads_dcpx_{n}"] = n
        CHECK_SOURCE_N[f"check_dcpx_loads_torch_{n}"] = n
        checks.append(_define(f"check_dcpx_{n}_same_placements",
                              _load_check(f"dcpx_{n}", SAME, "dcpx")))
        checks.append(_define(f"check_dcpx_{n}_other_placements",
                              _load_check(f"dcpx_{n}", SWAPPED, "dcpx")))
        checks.append(_define(f"check_torch_loads_dcpx_{n}",
                              _load_check(f"dcpx_{n}", SAME, "torch")))
        checks.append(_define(f"check_dcpx_loads_torch_{n}",
                              _load_check(f"torch_{n}", SWAPPED, "dcpx")))
        checks.append(_define(f"check_dcpx_{n}_into_plain_tensors",
                              _plain_check(f"dcpx_{n}")))
        CHECK_SOURCE_N[f"check_dcpx_{n}_cast_to_other_dtypes"] = n
        checks.append(_define(f"check_dcpx_{n}_cast_to_other_dtypes",
                              _cast_check(f"dcpx_{n}")))
        if m == 4:
            checks.append(_define(f"check_dcpx_{n}_into_2d_mesh",
                                  _load_check(f"dcpx_{n}", MESH_2D, "dcpx")))
    checks.append(_define("check_dcpx_4_2d_into_1d_mesh",
                          _load_check("dcpx_4_2d", SAME, "dcpx")))
    checks.append(check_many_chunks_4)
    return checks


LOAD_CHECKS = {m: load_checks(m) for m in SIZES}


# --------------------------------------------------------------------------
# the phases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The shared workdir and the save sessions (N = 1, 2, 4)."""
    workdir = tmp_path_factory.mktemp("reshard")
    return workdir, {n: CheckSession(n, [check_save], workdir, f"save{n}").run()
                     for n in SIZES}


@pytest.fixture(scope="module")
def loaded(saved):
    workdir, _ = saved
    return {m: CheckSession(m, LOAD_CHECKS[m], workdir, f"load{m}").run() for m in SIZES}


def _cases():
    for m in SIZES:
        for check in LOAD_CHECKS[m]:
            name = check.__name__
            n = CHECK_SOURCE_N[name]
            yield pytest.param(m, name, id=f"N{n}-M{m}-{name.removeprefix('check_')}")


@pytest.mark.parametrize("n", SIZES)
def test_save_at_world_size(saved, n):
    saved[1][n].assert_ok("check_save")


@pytest.mark.parametrize("m,check", list(_cases()))
def test_load_at_world_size(saved, loaded, m, check):
    loaded[m].assert_ok(check)


@pytest.mark.parametrize("source", [f"dcpx_{n}" for n in SIZES] + [f"torch_{n}" for n in SIZES]
                         + ["dcpx_4_2d", "many_4"])
def test_loads_into_plain_tensors_without_process_group(saved, source):
    workdir, sessions = saved
    sessions[4 if source.endswith("2d") else int(source[-1])].assert_ok("check_save")
    if source == "many_4":
        sd = {"many": torch.zeros(MANY_SHAPE)}
        dcpx.load(sd, checkpoint_id=workdir / source)
        assert_bit_equal(sd["many"], many_full(), "many")
        return
    sd = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in TENSORS.items()}
    sd.update({name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in PLAIN.items()})
    sd["meta"] = {"step": None, "names": None}
    dcpx.load(sd, checkpoint_id=workdir / source)
    for name in list(TENSORS) + list(PLAIN):
        assert_bit_equal(sd[name], full_of(name), f"{source}: {name}")
    assert sd["meta"] == NON_TENSOR["meta"]
