"""Rank coordination (issue #4, part 1): ``dcpx.save``, ``dcpx.async_save``
(THREAD) and ``dcpx.load`` across 2 and 4 ranks, through the default group
and through explicit process groups made by ``dist.new_group``.

2 ranks (one spawn, a check per pytest test):

* save / load through the default group and through an explicit group of
  both ranks (``.metadata`` is there on every rank as soon as its save
  returns; torch's ``dcp.load`` reads it too); ``async_save`` returning a
  ``Future`` (no stager) and an ``AsyncSaveResponse`` (a ``DefaultStager``
  staging asynchronously), whose checkpoint holds the values of the call even
  though the caller changes its tensors right after staging completes;
* ranks holding different keys (each written by its only holder) next to
  shared ones, any rank loading any key; ``no_dist=True`` saves one rank
  alone while the other is elsewhere;
* ``use_collectives=False``: every rank commits its own ``__{rank}.metadata``
  (no ``.metadata``), and ``dcpx.load`` and torch's ``dcp.load`` read each
  rank's back; for ``async_save`` too;
* ``async_save`` refuses a process group without a CPU backend
  (``"cuda:gloo"``: its only device type is cuda, as an NCCL-only group's)
  with torch's own message, before writing anything; for the default group
  too (a 1-rank spawn whose default group is ``"cuda:gloo"``);
* repeated ``async_save`` with one long-lived ``DefaultStager`` while the
  "training" keeps running ``all_reduce`` on the default group between and
  during the uploads (and with the uploads on a group of their own): no
  deadlock (bounded by the process-group timeout and the join timeout), the
  all_reduce results stay right, every checkpoint holds its step's values,
  and the stager allocates its buffer once.

4 ranks (one spawn):

* two disjoint subgroups ({0, 2} and {1, 3}) save, async-save and load
  different checkpoints at the same time, each coordinated inside its group
  (the group's rank 0 is global rank 1 for {1, 3});
* a 2 x 2 mesh whose "tp" sub-meshes each save their own 2-way sharded
  DTensor checkpoint with ``process_group`` = the sub-mesh's group, and load
  it back.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import dcpx
from conftest import assert_bit_equal
from dist_helpers import CheckSession, dtensor_of, full_value, read_metadata, spawn

pytestmark = pytest.mark.dist

CPU_HINT = ("A CPU backend must be enabled for async save; try initializing process group "
            "with 'cpu:gloo,cuda:nccl'")


def shared_state(tag: str) -> dict:
    """The same values on every rank (plain tensors are replicated state)."""
    return {
        "model": {"w": full_value(f"{tag}.w", (64, 32)),
                  "b": full_value(f"{tag}.b", (32,), torch.bfloat16)},
        "ids": torch.arange(100, dtype=torch.int64),
        "step": 7,
        "names": ["a", "b"],
        "cfg": {"lr": 0.25},
    }


def zeros_of(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = zeros_of(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_same(got: dict, exp: dict, what: str) -> None:
    for k, v in exp.items():
        if isinstance(v, dict):
            assert_same(got[k], v, f"{what}.{k}")
        elif isinstance(v, torch.Tensor):
            assert_bit_equal(got[k], v, f"{what}.{k}")
        else:
            assert got[k] == v, f"{what}.{k}: {got[k]!r} != {v!r}"


def upload_future(ret):
    """The upload future of async_save's return value (Future or
    AsyncSaveResponse)."""
    if isinstance(ret, dcpx.AsyncSaveResponse):
        return ret.upload_completion
    assert hasattr(ret, "result"), f"async_save returned {type(ret).__name__}"
    return ret


def assert_committed(path: str) -> None:
    assert os.path.exists(os.path.join(path, ".metadata")), f"no .metadata in {path}"


# --------------------------------------------------------------------------
# 2 ranks


def check_save_load_default_group(ctx):
    """dcpx.save / dcpx.load through the default group; the Metadata is
    returned on every rank; torch's dcp.load reads it too."""
    import torch.distributed.checkpoint as tdcp

    path = ctx.path("default")
    exp = shared_state("default")
    md = dcpx.save(shared_state("default"), checkpoint_id=path)
    assert isinstance(md, dcpx.Metadata), f"dcpx.save returned {type(md).__name__}"
    assert_committed(path)  # on every rank, as soon as save returns
    assert set(md.state_dict_metadata) == set(read_metadata(path).state_dict_metadata)
    sd = zeros_of(exp)
    dcpx.load(sd, checkpoint_id=path)
    assert_same(sd, exp, "dcpx.load")
    sd = zeros_of(exp)
    tdcp.load(sd, checkpoint_id=path)
    assert_same(sd, exp, "torch dcp.load")


def check_save_load_explicit_group(ctx):
    """The same through process_group=dist.new_group([0, 1]), a
    FileSystemWriter / FileSystemReader and checkpoint_id=None."""
    pg = dist.new_group([0, 1])
    path = ctx.path("explicit")
    exp = shared_state("explicit")
    dcpx.save(shared_state("explicit"), storage_writer=dcpx.FileSystemWriter(path),
              process_group=pg)
    dist.barrier(group=pg)
    assert_committed(path)
    sd = zeros_of(exp)
    dcpx.load(sd, storage_reader=dcpx.FileSystemReader(path), process_group=pg)
    assert_same(sd, exp, "dcpx.load through the explicit group")


def check_async_save_future(ctx):
    """async_save without a stager returns a Future of the Metadata; after
    it returns the caller may change its tensors."""
    path = ctx.path("async_future")
    exp = shared_state("async_future")
    sd = shared_state("async_future")
    ret = dcpx.async_save(sd, checkpoint_id=path)
    assert not isinstance(ret, dcpx.AsyncSaveResponse), "expected a Future without a stager"
    sd["model"]["w"].fill_(-1)  # staging is over: this must not reach the checkpoint
    md = ret.result(timeout=60)
    assert isinstance(md, dcpx.Metadata), f"the Future holds {type(md).__name__}"
    assert_committed(path)  # on every rank, as soon as its future is done
    got = zeros_of(exp)
    dcpx.load(got, checkpoint_id=path)
    assert_same(got, exp, "async_save (Future)")


def check_async_save_response_explicit_group(ctx):
    """With a DefaultStager staging asynchronously: an AsyncSaveResponse;
    the checkpoint holds the values at the call, through an explicit group."""
    pg = dist.new_group([0, 1])
    path = ctx.path("async_response")
    exp = shared_state("async_response")
    sd = shared_state("async_response")
    with dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)) as stager:
        ret = dcpx.async_save(sd, checkpoint_id=path, async_stager=stager, process_group=pg)
        assert isinstance(ret, dcpx.AsyncSaveResponse), f"got {type(ret).__name__}"
        ret.staging_completion.result(timeout=60)
        sd["model"]["w"].fill_(-1)
        sd["ids"].zero_()
        ret.upload_completion.result(timeout=60)
    dist.barrier(group=pg)
    assert_committed(path)
    got = zeros_of(exp)
    dcpx.load(got, checkpoint_id=path, process_group=pg)
    assert_same(got, exp, "async_save (AsyncSaveResponse, explicit group)")


def check_rank_specific_keys(ctx):
    """Ranks holding different keys (each written by its only holder, into
    its own file) next to shared ones; every rank can load any of them."""
    path = ctx.path("rank_keys")
    own = {r: full_value(f"own{r}", (32, 16)) for r in range(ctx.world_size)}
    sd = shared_state("rank_keys")
    sd[f"own{ctx.rank}"] = own[ctx.rank].clone()
    sd[f"count{ctx.rank}"] = ctx.rank + 10
    dcpx.save(sd, checkpoint_id=path)
    md = read_metadata(path)
    for r in range(ctx.world_size):
        assert f"own{r}" in md.state_dict_metadata and f"count{r}" in md.state_dict_metadata
        [(index, info)] = [(k, v) for k, v in md.storage_data.items() if k.fqn == f"own{r}"]
        assert info.relative_path.startswith(f"__{r}_"), (
            f"own{r}, held by rank {r} only, was written to {info.relative_path}")
    other = (ctx.rank + 1) % ctx.world_size
    got = zeros_of(shared_state("rank_keys"))
    got.update({f"own{ctx.rank}": torch.zeros(32, 16), f"own{other}": torch.zeros(32, 16),
                f"count{other}": None})
    dcpx.load(got, checkpoint_id=path)
    assert_same({k: got[k] for k in shared_state("rank_keys")}, shared_state("rank_keys"),
                "shared keys")
    assert_bit_equal(got[f"own{ctx.rank}"], own[ctx.rank], f"own{ctx.rank}")
    assert_bit_equal(got[f"own{other}"], own[other], f"own{other} (another rank's key)")
    assert got[f"count{other}"] == other + 10, got[f"count{other}"]


def check_no_dist_saves_alone(ctx):
    """no_dist=True with a process group: each rank saves and loads its own
    checkpoint as a single process, without the others."""
    path = ctx.path(f"no_dist{ctx.rank}")
    exp = _per_rank_state(ctx.rank)
    if ctx.rank == 0:  # rank 1 is not even saving at the same time
        dcpx.save(_per_rank_state(ctx.rank), checkpoint_id=path, no_dist=True)
    dist.barrier()
    if ctx.rank == 1:
        dcpx.save(_per_rank_state(ctx.rank), checkpoint_id=path, no_dist=True)
    assert_committed(path)
    got = {"x": torch.zeros(16, 8), "rank": None, "tag": None}
    dcpx.load(got, checkpoint_id=path, no_dist=True)
    assert_bit_equal(got["x"], exp["x"], "x")
    assert got["rank"] == ctx.rank


def _per_rank_state(rank: int) -> dict:
    return {"x": full_value(f"local{rank}", (16, 8)), "rank": rank, "tag": [f"r{rank}"]}


def check_use_collectives_false(ctx):
    """Each rank writes its own state and its own __{rank}.metadata without
    talking to the others; dcpx.load and torch's dcp.load read it back."""
    import torch.distributed.checkpoint as tdcp

    path = ctx.path("nocoll")
    exp = _per_rank_state(ctx.rank)
    dcpx.save(_per_rank_state(ctx.rank), checkpoint_id=path, use_collectives=False)
    dist.barrier()
    names = sorted(n for n in os.listdir(path) if "metadata" in n)
    assert names == ["__0.metadata", "__1.metadata"], (
        f"use_collectives=False must leave one __{{rank}}.metadata per rank and no "
        f".metadata: found {names}")
    md = read_metadata(path, rank=ctx.rank)
    assert set(md.state_dict_metadata) == {"x", "rank", "tag"}, sorted(md.state_dict_metadata)
    for loader in (dcpx.load, tdcp.load):
        got = {"x": torch.zeros(16, 8), "rank": None, "tag": None}
        loader(got, checkpoint_id=path)
        assert_bit_equal(got["x"], exp["x"], f"{loader.__module__}: rank {ctx.rank}'s x")
        assert got["rank"] == ctx.rank and got["tag"] == [f"r{ctx.rank}"], (
            f"{loader.__module__}: rank {ctx.rank} read {got['rank']!r}, {got['tag']!r}")


def check_async_use_collectives_false(ctx):
    path = ctx.path("nocoll_async")
    exp = _per_rank_state(ctx.rank)
    upload_future(dcpx.async_save(_per_rank_state(ctx.rank), checkpoint_id=path,
                                  use_collectives=False)).result(timeout=60)
    dist.barrier()
    names = sorted(n for n in os.listdir(path) if "metadata" in n)
    assert names == ["__0.metadata", "__1.metadata"], names
    got = {"x": torch.zeros(16, 8), "rank": None, "tag": None}
    dcpx.load(got, checkpoint_id=path)
    assert_bit_equal(got["x"], exp["x"], f"rank {ctx.rank}'s x")
    assert got["rank"] == ctx.rank


def check_collective_and_per_rank_saves_into_one_directory(ctx):
    """A directory saved with collectives, then without, then with again:
    each save, once it returned, is what dcpx and torch load.  Before, a
    use_collectives=False save deleted its rank's data files of the earlier
    collective checkpoint but left its .metadata, which load reads first:
    the save that succeeded did not load (missing files)."""
    import torch.distributed.checkpoint as tdcp

    path = ctx.path("mixed_modes")

    def state(tag):
        return {"x": full_value(f"{tag}{ctx.rank}", (16, 8)), "tag": f"{tag}{ctx.rank}"}

    def loads_back(tag, what):
        for loader in (dcpx.load, tdcp.load):
            got = {"x": torch.zeros(16, 8), "tag": None}
            loader(got, checkpoint_id=path)
            assert got["tag"] == f"{tag}{ctx.rank}", (
                f"{what}: {loader.__module__} on rank {ctx.rank} read {got['tag']!r}")
            assert_bit_equal(got["x"], state(tag)["x"], f"{what}: {loader.__module__}")

    # collective: the same keys on both ranks, rank 0's values are saved
    dcpx.save({"x": full_value("a0", (16, 8)), "tag": "a0"}, checkpoint_id=path)
    dist.barrier()
    dcpx.save(state("b"), checkpoint_id=path, use_collectives=False)
    dist.barrier()
    loads_back("b", "per-rank save over a collective one")
    names = sorted(n for n in os.listdir(path) if "metadata" in n)
    assert names == ["__0.metadata", "__1.metadata"], f"after the per-rank save: {names}"
    dist.barrier()
    dcpx.save({"x": full_value("c0", (16, 8)), "tag": "c0"}, checkpoint_id=path)
    dist.barrier()
    names = sorted(n for n in os.listdir(path) if "metadata" in n)
    assert names == [".metadata"], f"after the collective save: {names}"
    md = read_metadata(path)
    referenced = {si.relative_path for si in md.storage_data.values()}
    data = {n for n in os.listdir(path) if n.endswith(".distcp")}
    assert data == referenced, f"unreferenced data files left: {sorted(data - referenced)}"
    got = {"x": torch.zeros(16, 8), "tag": None}
    dcpx.load(got, checkpoint_id=path)
    assert got["tag"] == "c0"
    assert_bit_equal(got["x"], full_value("c0", (16, 8)), "collective save over a per-rank one")


def _refusals(ctx, group) -> dict:
    """dcpx's and torch's async_save on ``group``: {name: message}."""
    import torch.distributed.checkpoint as tdcp

    path = ctx.path(f"nocpu{ctx.rank}")
    errors = {}
    for name, fn in (("dcpx", dcpx.async_save), ("torch", tdcp.async_save)):
        try:
            ret = fn({"x": torch.ones(3)}, checkpoint_id=path, process_group=group)
        except AssertionError as e:
            errors[name] = str(e)
        else:
            upload_future(ret).exception(timeout=30)
            raise AssertionError(f"{name}.async_save accepted a process group whose device "
                                 f"types are {group._device_types if group else None}")
    assert CPU_HINT in errors["dcpx"], f"dcpx's message: {errors['dcpx']!r}"
    assert errors["dcpx"] == errors["torch"], errors
    assert not os.path.exists(path) or not os.listdir(path), (
        f"async_save wrote {os.listdir(path)} before refusing the group")
    return errors


def check_async_save_refuses_group_without_cpu_backend(ctx):
    """A group with only a CUDA backend ("cuda:gloo": its device types are
    [cuda], as an NCCL-only group's): torch's message, in the call, nothing
    written."""
    _refusals(ctx, dist.new_group(backend="cuda:gloo"))


def _train_and_save(ctx, path_of, steps, process_group=None):
    """Steps of "training" (all_reduce on the default group, in the same
    number on every rank) with one async_save per step through a long-lived
    DefaultStager; the all_reduces go on until every rank's upload is done,
    so they run during the uploads as well as between them."""
    world = ctx.world_size
    expected_sum = float(sum(range(1, world + 1)))
    base = full_value("train.w", (128, 64))

    def w_at(step):  # the same operations here and in the check below
        return base.clone().add_(float(step))

    state = {"w": base.clone(), "step": 0, "rng": torch.zeros(4, dtype=torch.int64)}
    during = 0
    with dcpx.DefaultStager() as stager:  # default options: async staging
        for step in range(steps):
            state["w"].copy_(w_at(step))
            state["step"] = step
            state["rng"].fill_(step)
            ret = dcpx.async_save(state, checkpoint_id=path_of(step), async_stager=stager,
                                  process_group=process_group)
            up = upload_future(ret)
            if isinstance(ret, dcpx.AsyncSaveResponse):
                ret.staging_completion.result(timeout=60)
            state["w"].fill_(-7.0)  # the caller may change its tensors now
            state["rng"].fill_(-1)
            try:
                while True:
                    x = torch.full((4096,), float(ctx.rank + 1))
                    dist.all_reduce(x)
                    assert bool((x == expected_sum).all()), (
                        f"step {step}: all_reduce during an async save gave "
                        f"{x[:4].tolist()}, expected {expected_sum}")
                    done = torch.tensor([1 if up.done() else 0])
                    dist.all_reduce(done, op=dist.ReduceOp.MIN)
                    if done.item():
                        break
                    during += 1
            except RuntimeError as e:
                raise AssertionError(
                    f"step {step}: the training's all_reduce on the default group failed "
                    f"while async_save's upload was in flight (upload done on this rank: "
                    f"{up.done()}); did the upload's collectives interleave with the "
                    f"training's on the same group? {e}") from e
            up.result(timeout=60)
        allocs = stager.alloc_count
    assert allocs == 1, f"the long-lived stager allocated {allocs} buffers for one structure"
    dist.barrier()
    for step in sorted({path_of(s): s for s in range(steps)}.values()):
        got = {"w": torch.zeros(128, 64), "step": None, "rng": torch.zeros(4, dtype=torch.int64)}
        dcpx.load(got, checkpoint_id=path_of(step))
        assert_bit_equal(got["w"], w_at(step), f"w saved at step {step}")
        assert got["step"] == step, f"step saved at step {step}: {got['step']!r}"
        assert_bit_equal(got["rng"], torch.full((4,), step, dtype=torch.int64), "rng")
    return during


def check_repeated_async_saves_with_training_collectives(ctx):
    _train_and_save(ctx, lambda s: ctx.path("train", f"step{s}"), steps=6)


def check_repeated_async_saves_on_own_group_with_training_collectives(ctx):
    ckpt_pg = dist.new_group(backend="gloo")
    _train_and_save(ctx, lambda s: ctx.path("train_pg", f"step{s}"), steps=4,
                    process_group=ckpt_pg)


def check_repeated_async_saves_into_one_directory(ctx):
    """Re-saving into the same directory: each load sees the latest step."""
    path = ctx.path("train_same")
    _train_and_save(ctx, lambda s: path, steps=1)
    _train_and_save(ctx, lambda s: path, steps=3)


CHECKS_2 = [check_save_load_default_group, check_save_load_explicit_group,
            check_async_save_future, check_async_save_response_explicit_group,
            check_rank_specific_keys, check_no_dist_saves_alone,
            check_use_collectives_false, check_async_use_collectives_false,
            check_collective_and_per_rank_saves_into_one_directory,
            check_async_save_refuses_group_without_cpu_backend,
            check_repeated_async_saves_with_training_collectives,
            check_repeated_async_saves_on_own_group_with_training_collectives,
            check_repeated_async_saves_into_one_directory]


# --------------------------------------------------------------------------
# 4 ranks


def check_disjoint_subgroups(ctx):
    """{0, 2} and {1, 3} save, async-save and load their own checkpoints at
    the same time, each coordinated within its group."""
    groups = {0: dist.new_group([0, 2]), 1: dist.new_group([1, 3])}  # all ranks, same order
    gid = ctx.rank % 2
    pg = groups[gid]
    tag = f"group{gid}"
    exp = shared_state(tag)
    exp["members"] = [gid, gid + 2]
    for api in ("save", "async_save"):
        path = ctx.path(f"{tag}_{api}")
        sd = shared_state(tag)
        sd["members"] = [gid, gid + 2]
        if api == "save":
            dcpx.save(sd, checkpoint_id=path, process_group=pg)
        else:
            upload_future(dcpx.async_save(sd, checkpoint_id=path, process_group=pg)
                          ).result(timeout=60)
        dist.barrier(group=pg)
        assert_committed(path)
        got = zeros_of(exp)
        got["members"] = None
        dcpx.load(got, checkpoint_id=path, process_group=pg)
        assert_same(got, exp, f"{api} by group {gid}")
    dist.barrier()
    # The two groups' checkpoints are each complete and hold their own values.
    for other in (0, 1):
        md = read_metadata(ctx.path(f"group{other}_save"))
        assert "members" in md.state_dict_metadata


def check_submesh_groups_save_sharded(ctx):
    """A (2, 2) mesh: each "tp" row ({0, 1} and {2, 3}) saves a 2-way sharded
    DTensor with process_group = its row's group, into its own directory."""
    from torch.distributed.device_mesh import init_device_mesh
    from dtensor_api import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    row = mesh.get_coordinate()[0]
    full = full_value(f"row{row}", (6, 8))
    path = ctx.path(f"tp_row{row}")
    for api in ("save", "async_save"):
        sd = {"t": dtensor_of(full, tp, [Shard(1)]), "row": row}
        p = f"{path}_{api}"
        if api == "save":
            dcpx.save(sd, checkpoint_id=p, process_group=tp.get_group())
        else:
            upload_future(dcpx.async_save(sd, checkpoint_id=p, process_group=tp.get_group())
                          ).result(timeout=60)
        dist.barrier()
        md = read_metadata(p)
        chunks = sorted((tuple(c.offsets), tuple(c.sizes))
                        for c in md.state_dict_metadata["t"].chunks)
        assert chunks == [((0, 0), (6, 4)), ((0, 4), (6, 4))], f"{api}: {chunks}"
        got = {"t": dtensor_of(torch.zeros(6, 8), tp, [Shard(1)]), "row": None}
        dcpx.load(got, checkpoint_id=p, process_group=tp.get_group())
        assert_bit_equal(got["t"].full_tensor(), full, f"{api}: row {row}")
        assert got["row"] == row


CHECKS_4 = [check_disjoint_subgroups, check_submesh_groups_save_sharded]


def _refuse_on_default_group(rank, world_size, workdir):
    from dist_helpers import CheckContext
    from pathlib import Path

    return _refusals(CheckContext(rank, world_size, Path(workdir), {}), None)


def test_async_save_refuses_default_group_without_cpu_backend(tmp_path):
    """The default group itself has only a CUDA backend
    (init_process_group("cuda:gloo")), and async_save gets no group."""
    spawn(_refuse_on_default_group, 1, str(tmp_path), backend="cuda:gloo")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return CheckSession(2, CHECKS_2, tmp_path_factory.mktemp("coord2")).run()


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return CheckSession(4, CHECKS_4, tmp_path_factory.mktemp("coord4")).run()


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS_2])
def test_coordination_2_ranks(two, check):
    two.assert_ok(check)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS_4])
def test_coordination_4_ranks(four, check):
    four.assert_ok(check)
