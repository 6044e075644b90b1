"""benchmarks/bench_scale.py's simulation against the real protocols: a real
2-rank gloo save (dcpx's, three times: full plan exchange, then plan by digest
with steady-state saves off, then a steady-state save; and torch DCP's with
plan caching, twice) records every message rank 0 and rank 1 send and
receive, and every all-reduce, and the simulation of the same model (same
keys, shapes, dtypes, sharding, directory name lengths) must produce:

* dcpx: byte-identical plan blobs and digests, the same assignments and tokens,
  the same file layouts (offsets, lengths), messages of the same pickled sizes
  in every collective, all-reduces of the same number and bytes, and a
  ``.metadata`` of the same size that decodes to the same tensors and chunks
  (the steady-state save's too: it was steady, ``dist.STEADY_SAVES``);
* torch: equal SavePlans (WriteItems, planner data), the same global plans and
  write results, messages of the same pickled sizes, the same ``.metadata`` size;
* at load, each rank's reads (chunks found) and its lstat count as dcpx's real
  load makes them.

So the harness cannot drift from the real protocol unnoticed: a change of
dcpx's messages fails here until ``DcpxProtocol`` follows it.
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest

from dist_helpers import REPO, spawn

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_scale as bs  # noqa: E402

WORLD = 2
TENSORS = 12
KINDS = ("fsdp2", "ddp")


def _model(kind: str):
    return bs.make_model(kind, WORLD, TENSORS, group=WORLD, dims="tiny")


# --------------------------------------------------------------------------
# on the ranks


@contextlib.contextmanager
def _recording(log: list):
    """Every object the ranks pass through torch's object collectives (rank
    side: what this rank pickles; and what it unpickles), in order, with the
    collective it belongs to; and the bytes of every all-reduce."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    to_tensor, to_object = c10d._object_to_tensor, c10d._tensor_to_object
    all_reduce = dist.all_reduce

    def rec_all_reduce(t, *a, **kw):
        log.append(("reduce", None, t.numel() * t.element_size()))
        return all_reduce(t, *a, **kw)

    def rec_to_tensor(obj, *a, **kw):
        out = to_tensor(obj, *a, **kw)
        log.append(("sent", obj, int(out[1].item())))
        return out

    def rec_to_object(*a, **kw):
        obj = to_object(*a, **kw)
        log.append(("got", obj, None))
        return obj
    c10d._object_to_tensor, c10d._tensor_to_object = rec_to_tensor, rec_to_object
    dist.all_reduce = rec_all_reduce
    try:
        yield log
    finally:
        c10d._object_to_tensor, c10d._tensor_to_object = to_tensor, to_object
        dist.all_reduce = all_reduce


def real_saves(rank: int, world_size: int, root: str) -> dict:
    """Per shape (FSDP2, DDP): what this rank's collectives carried in three dcpx
    saves (the third steady-state) and two torch saves (plan caching) of the
    model, and its load's reads and lstat calls."""
    return {kind: _real_saves(rank, world_size, os.path.join(root, kind), kind)
            for kind in KINDS}


def _real_saves(rank: int, world_size: int, root: str, kind: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import dcpx
    from dcpx.coordination import dist as _dist
    model = _model(kind)
    mesh = None
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world_size,))
    sd = bs._real_state_dict(model, rank, mesh)
    bs.fresh_caches()  # the first save of this shape is a first save
    out: dict = {}
    for lib in ("dcpx", "torch"):
        for i in (1, 2, 3) if lib == "dcpx" else (1, 2):
            log: list = []
            path = os.path.join(root, f"real{lib[0]}{i}")
            steady0 = _dist.STEADY_SAVES[0]
            # the third dcpx save: steady-state saves on (fresh_caches turned
            # them off, so that the second took the exchange by digest)
            _dist.steady_state_enabled = i == 3
            try:
                with _recording(log):
                    if lib == "dcpx":
                        dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path,
                                                                            sync_files=False))
                    else:
                        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=False),
                                 planner=bs.TorchProtocol.planner(True))
            finally:
                _dist.steady_state_enabled = False
            out[f"{lib}{i}"] = log
            out[f"{lib}{i}_steady"] = _dist.STEADY_SAVES[0] - steady0
    # dcpx's load of the second checkpoint: the reads it plans, the lstat calls
    plans: list = []
    real_plan_reads = _dist.plan_reads

    def rec_plan_reads(*a, **kw):
        reads, keys = real_plan_reads(*a, **kw)
        plans.append(sorted((r.key, tuple(r.chunk), r.info.offset, r.info.length)
                            for r in reads))
        return reads, keys
    _dist.plan_reads = rec_plan_reads
    try:
        with bs.FsCounter() as fs:
            dcpx.load(sd, checkpoint_id=os.path.join(root, "reald2"))
    finally:
        _dist.plan_reads = real_plan_reads
    # DDP's plain tensors take the direct read plan (no plan_reads): no list
    out["load"] = {"reads": plans[0] if plans else None, "lstat": fs.counts["lstat"]}
    return out


# --------------------------------------------------------------------------
# in the test process


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """One 2-rank run (interpreter starts are the cost) for both shapes."""
    root = tmp_path_factory.mktemp("scale")
    return str(root), spawn(real_saves, WORLD, str(root))


@pytest.fixture(params=KINDS)
def real(request, real_runs):
    root, logs = real_runs
    kind = request.param
    return kind, os.path.join(root, kind), [rank_logs[kind] for rank_logs in logs]


def _messages(log: list, what: str) -> list:
    return [obj for kind, obj, _ in log if kind == what]


def _sizes(log: list) -> list:
    return [n for kind, _, n in log if kind == "sent"]


def _own(log: list, r: int) -> tuple:
    """(plan message, write report, reply) of rank r in one save's log: rank 0
    also pickles every rank's reply and the broadcast, and unpickles every
    rank's messages (torch's object collectives unpickle the root's own too)."""
    sent, got = _messages(log, "sent"), _messages(log, "got")
    if r == 0:
        return sent[0], sent[1 + WORLD], got[WORLD]
    return sent[0], sent[1], got[0]


@contextlib.contextmanager
def _fresh_dcpx():
    from dcpx.coordination import dist as _dist
    _dist.clear_exchange_cache()
    try:
        yield
    finally:
        _dist.clear_exchange_cache()


def test_dcpx_messages_match_a_real_save(real):
    """The simulated plan messages (blob, digest, token), the replies they are
    given and the layout reports of both saves are the real ones."""
    kind, root, logs = real
    model = _model(kind)
    proto = bs.DcpxProtocol(model)
    held: dict = {}
    for i in (1, 2):
        path = os.path.join(root, f"reald{i}")
        for r in range(WORLD):
            plan_msg, layout_msg, reply = _own(logs[r][f"dcpx{i}"], r)
            if i == 1:
                s, msg = proto.first_message(r, path)
                assert msg[1] is not None and msg[1] == plan_msg[1], \
                    f"rank {r}: the simulated plan blob is not what dcpx sends"
            else:
                s, msg = held[r], proto.repeat_message(held[r], path)
                assert msg[1] is None, "the repeated save sends its digest only"
            assert msg == plan_msg, f"rank {r}, save {i}"
            prefix, mine, held[r] = proto.take_reply(s, reply)
            lay = proto.layout_message(held[r], prefix, mine)
            assert lay == layout_msg, f"rank {r}, save {i}: layouts differ"


def test_dcpx_simulated_save_counts_the_real_bytes(real, tmp_path):
    """``dcpx_save`` over the model: rank 0's pickled bytes in every collective
    are the real save's, and the ``.metadata`` has the real one's size and
    content (chunks, extents)."""
    from dcpx.formats.metadata import loads
    kind, root, logs = real
    model = _model(kind)
    # the simulated directories' names have the real ones' lengths
    sim = {}
    with _fresh_dcpx():
        state: dict = {}
        for i in (1, 2, 3):
            d = os.path.join(root, f"simud{i}")
            sim[i] = bs.dcpx_save(model, d, state, repeat=i == 2, steady=i == 3)
    for i in (1, 2, 3):
        for r in range(WORLD):
            # every all-reduce (the steady-state checks), with its bytes
            real_red = [n for kind, _, n in logs[r][f"dcpx{i}"] if kind == "reduce"]
            assert real_red == [c["rank0_in"] for c in sim[i]["collectives"]
                                if c["kind"] == "all_reduce"], f"rank {r}, save {i}"
        assert [lg[f"dcpx{i}_steady"] for lg in logs] == [int(i == 3)] * WORLD, \
            f"save {i}: steady-state saves on the ranks"
        real_sizes = _sizes(logs[0][f"dcpx{i}"])
        s = [c for c in sim[i]["collectives"] if c["kind"] != "all_reduce"]
        if i == 3:
            # the steady-state save: the tag and the outcome broadcast;
            # rank 1 pickles nothing
            assert [c["kind"] for c in s] == ["broadcast", "broadcast"]
            assert real_sizes == [c["rank0_pickled"] for c in s]
            assert _sizes(logs[1]["dcpx3"]) == []
            assert [n for kind, _, n in logs[1]["dcpx3"] if kind == "got"] == [None, None]
            assert sum(c["other_in"] for c in sim[3]["collectives"]) < 1000
        else:
            # gather 1, R replies, gather 2, broadcast
            assert [c["kind"] for c in s] == ["gather", "scatter", "gather", "broadcast"]
            assert real_sizes[0] == s[0]["rank0_pickled"]
            assert sum(real_sizes[1:1 + WORLD]) == s[1]["rank0_pickled"]
            assert real_sizes[1 + WORLD] == s[2]["rank0_pickled"]
            assert real_sizes[2 + WORLD] == s[3]["rank0_pickled"]
            # rank 1's own plan and layout messages
            r1 = _sizes(logs[1][f"dcpx{i}"])
            assert r1[0] == s[0]["other_out"] and r1[1] == s[2]["other_out"]
        real_md = open(os.path.join(root, f"reald{i}", ".metadata"), "rb").read()
        sim_md = open(os.path.join(root, f"simud{i}", ".metadata"), "rb").read()
        assert len(real_md) == len(sim_md) == sim[i]["metadata_bytes"]
        a, b = loads(real_md, "real"), loads(sim_md, "sim")
        assert a.state_dict_metadata == b.state_dict_metadata
        assert a.planner_data == b.planner_data
        ext = lambda md: sorted((k.fqn, tuple(k.offset), v.offset, v.length)  # noqa: E731
                                for k, v in md.storage_data.items())
        assert ext(a) == ext(b)


def test_dcpx_simulated_load_finds_the_real_reads(real):
    """Each rank's simulated load plans the reads the real load planned (FSDP2;
    DDP's real load takes the direct read plan, the simulation plan_reads: one
    whole-tensor read per key), with as many lstat calls."""
    kind, root, logs = real
    model = _model(kind)
    for r in range(WORLD):
        got = bs.dcpx_load_rank(model, r, os.path.join(root, "reald2"), keep_reads=True)
        if kind == "fsdp2":
            assert got["read_list"] == logs[r]["load"]["reads"]
        else:
            assert [k for k, *_ in got["read_list"]] == sorted(model.keys)
            assert all(chunk == model.shapes[model.keys.index(k)]
                       for k, chunk, *_ in got["read_list"])
        # the C decoder's path (2 data files): one lstat per data file the
        # rank reads (issue 28: only those), its own one under FSDP2
        assert got["decoder"].startswith("C")
        files = {x.relative_path for x in got["infos"]}
        assert got["by_call"]["lstat"] == logs[r]["load"]["lstat"] == len(files)
        if kind == "fsdp2":
            assert len(files) == 1


def test_torch_messages_match_a_real_save(real, tmp_path):
    """torch: the simulated local plans and write results are the real ones,
    the repeated save sends torch's unchanged-plan marker, and the pickled
    sizes and ``.metadata`` size of the simulated saves are the real saves'."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    kind, root, logs = real
    model = _model(kind)
    proto = bs.TorchProtocol(model)
    for r in range(WORLD):
        plan_msg, results_msg, central = _own(logs[r]["torch1"], r)
        w = FileSystemWriter(str(tmp_path / "w"), sync_files=False)
        plan, _ = proto.local_plan(r, w, caching=True)
        assert plan == plan_msg, f"rank {r}: the simulated SavePlan is not torch's"
        res = proto.write_results(central)
        assert [x.index for x in res] == [x.index for x in results_msg]
        assert res == results_msg, f"rank {r}: write results differ"
        assert _own(logs[r]["torch2"], r)[0] == proto.unchanged_plan()
    state: dict = {}
    sim = {i: bs.torch_save(model, os.path.join(root, f"simut{i}"), state, repeat=i == 2)
           for i in (1, 2)}
    for i in (1, 2):
        real_sizes = _sizes(logs[0][f"torch{i}"])
        s = sim[i]["collectives"]
        assert real_sizes[0] == s[0]["rank0_pickled"]
        assert sum(real_sizes[1:1 + WORLD]) == s[1]["rank0_pickled"]
        assert real_sizes[1 + WORLD] == s[2]["rank0_pickled"]
        assert real_sizes[2 + WORLD] == s[3]["rank0_pickled"]
        real_md = os.path.getsize(os.path.join(root, f"realt{i}", ".metadata"))
        assert real_md == sim[i]["metadata_bytes"]
