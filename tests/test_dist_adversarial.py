"""Multi-rank save / load flows looked at adversarially (2 ranks, gloo on
CPU, one spawn): every save is loaded back with dcpx and with torch's
dcp.load into fresh state dicts and compared bit-exact on every rank.

* consecutive saves into successive directories whose layout changes on
  one rank only (a rank-local tensor's dtype, then its shape, a key on one
  rank only, then the first layout again), with the plan exchange by digest
  between them;
* a replicated non-tensor value that differs between the ranks: both
  libraries load one of the values, the same on every rank;
* DTensors (Shard(0) uneven, Shard(1), Replicate) saved by dcpx and by
  torch at 2 ranks, loaded by both at 2 ranks with another placement and
  into plain tensors;
* use_collectives=False saves (dcpx's and torch's) loaded by both
  libraries; then a collective save into another directory;
* a process group that holds rank 1 only: save, async_save and load on it;
* async_save with the default group, three saves in flight into
  successive directories (THREAD, then PROCESS), the second of which fails
  on rank 1 (a Stateful raising in its state_dict, inside the async_save
  call): nothing of it is committed, rank 0's upload of it fails naming
  rank 1's error (before: a gloo timeout after the group's timeout), the
  others commit and load, and the next save works; the same with
  use_collectives=False (rank 0's own checkpoint commits) and with a
  storage writer of torch's; a failed async staging with
  use_collectives=False; every rank's call failing;
* the failing rank's side of a save torch's planner drives
  (``_dist.abort_torch_save``): its own error, no warning from torch;
* ranks with empty state dicts or non-tensor values only beside ranks
  with tensors.

Fail on main: check_async_in_flight_one_fails_on_rank_1,
check_async_fails_on_rank_1_per_rank_and_foreign_writer,
check_async_staging_fails_on_rank_1_per_rank,
check_abort_torch_save_warns_nothing.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import dcpx
from conftest import assert_bit_equal
from dist_helpers import CheckSession, dtensor_of, full_value

WORLD = 2


# --------------------------------------------------------------------------
# helpers (run on the ranks)


def _fresh_like(v):
    from dtensor_api import DTensor

    if isinstance(v, dict):
        return {k: _fresh_like(x) for k, x in v.items()}
    if isinstance(v, DTensor):
        return dtensor_of(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh, v.placements)
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    return None


def _compare(got, exp, what: str) -> None:
    from dtensor_api import DTensor

    if isinstance(exp, dict):
        assert isinstance(got, dict) and set(got) == set(exp), (what, got, exp)
        for k in exp:
            _compare(got[k], exp[k], f"{what}.{k}")
    elif isinstance(exp, DTensor):
        assert isinstance(got, DTensor), (what, type(got))
        assert_bit_equal(got.to_local(), exp.to_local(), what)
    elif isinstance(exp, torch.Tensor):
        assert_bit_equal(got, exp, what)
    else:
        assert got == exp, f"{what}: {got!r} != {exp!r}"


def load_both(path: str, like: dict, expect: dict = None, group=None, **kw) -> None:
    """Load ``path`` with dcpx and with torch into fresh state dicts shaped
    like ``like`` and compare each with ``expect`` (default ``like``)."""
    import torch.distributed.checkpoint as tdcp

    for lib in (dcpx, tdcp):
        got = _fresh_like(like)
        lib.load(got, checkpoint_id=path, process_group=group, **kw)
        _compare(got, like if expect is None else expect, f"{lib.__name__}:{path}")


def _mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, "cpu")


# --------------------------------------------------------------------------
# checks


def check_layouts_change_on_one_rank(ctx):
    r = ctx.rank

    def sd(step, dtype=torch.float32, rows=4, extra=False):
        out = {"rep": full_value(f"{step}.rep", (3, 5)),
               f"own{r}": full_value(f"{step}.own{r}", (rows,), dtype if r == 1 else None),
               "n": {"step": step, "lr": 0.5}}
        if extra and r == 1:
            out["only1"] = full_value(f"{step}.only1", (2, 2), torch.int16)
        return out

    layouts = [dict(), dict(dtype=torch.float64), dict(dtype=torch.float64, rows=7),
               dict(dtype=torch.float64, rows=7, extra=True), dict(), dict(extra=True),
               dict()]
    for step, kw in enumerate(layouts):
        path = ctx.path("layouts", str(step))
        s = sd(step, **kw)
        dcpx.save(s, checkpoint_id=path)
        load_both(path, s)
        # same layout again, new values, same directory name + "b"
        s2 = sd(step + 100, **kw)
        dcpx.save(s2, checkpoint_id=path + "b")
        load_both(path + "b", s2)


def check_replicated_value_differs_between_ranks(ctx):
    import torch.distributed.checkpoint as tdcp

    r = ctx.rank
    for lib in (dcpx, tdcp):
        path = ctx.path("diffval", lib.__name__)
        sd = {"w": full_value("w", (4,)), "v": f"rank{r}", "k": r * 1000}
        lib.save(sd, checkpoint_id=path)
        got = []
        for reader in (dcpx, tdcp):
            d = {"w": torch.zeros(4), "v": None, "k": None}
            reader.load(d, checkpoint_id=path)
            assert_bit_equal(d["w"], sd["w"], path)
            got.append((d["v"], d["k"]))
        assert got[0] == got[1], (path, got)
        assert got[0][0] in ("rank0", "rank1") and got[0][1] in (0, 1000), got
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, got[0])
        assert everyone[0] == everyone[1], (path, everyone)


def check_dtensor_reshard_both_libraries(ctx):
    import torch.distributed.checkpoint as tdcp
    from dtensor_api import Replicate, Shard

    mesh = _mesh()
    full = {"a": full_value("dt.a", (7, 5)), "b": full_value("dt.b", (3, 9), torch.bfloat16),
            "c": full_value("dt.c", (1, 4), torch.float64)}
    layouts = {
        "s0": {"a": [Shard(0)], "b": [Shard(0)], "c": [Shard(0)]},
        "s1": {"a": [Shard(1)], "b": [Shard(1)], "c": [Shard(1)]},
        "rep": {"a": [Replicate()], "b": [Shard(1)], "c": [Replicate()]},
    }

    def sd_of(name):
        return {k: dtensor_of(full[k], mesh, p) for k, p in layouts[name].items()}

    for saver in (dcpx, tdcp):
        for src in layouts:
            path = ctx.path("dtensor", saver.__name__, src)
            saver.save(sd_of(src), checkpoint_id=path)
            for dst in layouts:
                load_both(path, sd_of(dst))
            # plain tensors, every rank the whole value
            load_both(path, dict(full))


def check_per_rank_saves_both_libraries(ctx):
    import torch.distributed.checkpoint as tdcp

    r = ctx.rank
    for saver in (dcpx, tdcp):
        for step in range(2):
            path = ctx.path("alone", saver.__name__, str(step))
            sd = {"w": full_value(f"{step}.{r}.w", (5, 3)),
                  f"own{r}": full_value(f"o{r}", (r + 2,)),
                  "meta": {"rank": r, "step": step}}
            saver.save(sd, checkpoint_id=path, use_collectives=False)
            assert os.path.exists(os.path.join(path, f"__{r}.metadata"))
            load_both(path, sd)
        # a collective save into a new directory afterwards still works
        path = ctx.path("alone", saver.__name__, "collective")
        sd = {"w": full_value("c.w", (5, 3)), f"own{r}": full_value(f"c{r}", (3,))}
        saver.save(sd, checkpoint_id=path)
        load_both(path, sd)


def check_group_of_rank_1_only(ctx):
    import torch.distributed.checkpoint as tdcp

    g = dist.new_group([1])
    if ctx.rank == 1:
        for saver in (dcpx, tdcp):
            path = ctx.path("sub", saver.__name__)
            sd = {"w": full_value("sub.w", (6,)), "x": {"y": 3}}
            saver.save(sd, checkpoint_id=path, process_group=g)
            load_both(path, sd, group=g)
        path = ctx.path("sub", "async")
        sd = {"w": full_value("sub.async", (6,)), "n": 1}
        dcpx.async_save(sd, checkpoint_id=path, process_group=g).result(timeout=60)
        load_both(path, sd, group=g)
        sd = {"w": full_value("sub.async2", (6,)), "n": 2}
        dcpx.async_save(sd, checkpoint_id=path + "2", process_group=g).result(timeout=60)
        load_both(path + "2", sd, group=g)
    dist.barrier()


class _Boom:
    """A Stateful whose state_dict raises on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self):
        if self.rank == 1:
            raise RuntimeError("boom on rank 1")
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd):
        pass


def check_async_in_flight_one_fails_on_rank_1(ctx):
    """Three async_saves in flight (THREAD, then PROCESS uploads), the
    second raising inside rank 1's call."""
    for kind in (dcpx.AsyncCheckpointerType.THREAD, dcpx.AsyncCheckpointerType.PROCESS):
        _in_flight_one_fails_on_rank_1(ctx, kind)


def _in_flight_one_fails_on_rank_1(ctx, kind):
    r = ctx.rank
    sds = [{"w": full_value(f"af{i}.w", (64, 64)), "r": {"n": i}} for i in range(4)]
    futs, errs = [], []
    for i in range(3):
        path = ctx.path("inflight", kind.value, str(i))
        sd = dict(sds[i])
        if i == 1:
            sd["boom"] = _Boom(r)
        try:
            futs.append(dcpx.async_save(sd, checkpoint_id=path, async_checkpointer_type=kind))
        except Exception as e:  # rank 1's second call
            futs.append(None)
            errs.append(e)
    outcomes = []
    for f in futs:
        if f is None:
            outcomes.append("raised")
            continue
        try:
            f.result(timeout=120)
            outcomes.append("ok")
        except Exception as e:
            outcomes.append(f"failed: {type(e).__name__}: {e}")
    assert outcomes[0] == "ok" and outcomes[2] == "ok", outcomes
    if r == 0:
        # Told by rank 1 in the save's first collective, not by the group's
        # timeout (30 s here, 30 min by default) while rank 1 never came.
        assert outcomes[1].startswith("failed") and "boom on rank 1" in outcomes[1], outcomes
    else:
        assert outcomes[1] == "raised" and "boom on rank 1" in str(errs[0]), (outcomes, errs)
    assert not os.path.exists(ctx.path("inflight", kind.value, "1", ".metadata"))
    for i in (0, 2):
        load_both(ctx.path("inflight", kind.value, str(i)), sds[i])
    # the next save works, sync and async
    path = ctx.path("inflight", kind.value, "3")
    dcpx.async_save(sds[3], checkpoint_id=path, async_checkpointer_type=kind).result(timeout=60)
    load_both(path, sds[3])
    dcpx.save(sds[3], checkpoint_id=path + "s")
    load_both(path + "s", sds[3])


def check_async_fails_on_rank_1_per_rank_and_foreign_writer(ctx):
    """As above, with use_collectives=False (rank 0's own checkpoint stands:
    rank 1 meets it at the closing barrier) and with a storage writer of
    torch's (torch's planner runs the save: rank 0 is told through torch's
    own first collective)."""
    import torch.distributed.checkpoint as tdcp

    r = ctx.rank
    # use_collectives=False
    path = ctx.path("inflight_alone")
    sd = {"w": full_value("ia.w", (8,)), "boom": _Boom(r)}
    try:
        fut = dcpx.async_save(sd, checkpoint_id=path, use_collectives=False)
    except Exception as e:
        assert r == 1 and "boom on rank 1" in str(e), e
    else:
        assert r == 0
        fut.result(timeout=120)  # its own checkpoint, committed
        assert os.path.exists(os.path.join(path, "__0.metadata"))
    # torch's writer
    path = ctx.path("inflight_foreign")
    sd = {"w": full_value("if.w", (8,)), "boom": _Boom(r)}
    try:
        fut = dcpx.async_save(sd, storage_writer=tdcp.FileSystemWriter(path))
    except Exception as e:
        assert r == 1 and "boom on rank 1" in str(e), e
    else:
        assert r == 0
        with pytest.raises(BaseException, match="boom on rank 1"):  # CheckpointException
            fut.result(timeout=120)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    # and the next saves of either kind work
    sd = {"w": full_value("next.w", (8,)), "n": 7}
    dcpx.async_save(sd, storage_writer=tdcp.FileSystemWriter(path + "2")).result(timeout=60)
    load_both(path + "2", sd)
    dcpx.async_save(sd, checkpoint_id=path + "3").result(timeout=60)
    load_both(path + "3", sd)


class _FailingStager:
    """A stager of the user's whose staging (a Future) fails on rank 1."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def stage(self, sd):
        from concurrent.futures import Future

        f: Future = Future()
        if self.rank == 1:
            f.set_exception(RuntimeError("staging failed on rank 1"))
        else:
            f.set_result(sd)
        return f

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def check_async_staging_fails_on_rank_1_per_rank(ctx):
    """use_collectives=False, rank 1's staging Future fails: the other
    ranks only meet it at the save's closing barrier, so rank 0's own
    checkpoint stands and its upload does not fail; the next save works."""
    r = ctx.rank
    path = ctx.path("staging_alone")
    sd = {"w": full_value("sa.w", (8,)), "n": 1}
    resp = dcpx.async_save(sd, checkpoint_id=path, use_collectives=False,
                           async_stager=_FailingStager(r))
    if r == 0:
        resp.upload_completion.result(timeout=120)
        assert os.path.exists(os.path.join(path, "__0.metadata"))
    else:
        with pytest.raises(BaseException, match="staging failed on rank 1"):
            resp.upload_completion.result(timeout=120)
    sd = {"w": full_value("sa2.w", (8,)), "n": 2}
    dcpx.async_save(sd, checkpoint_id=path + "2").result(timeout=60)
    load_both(path + "2", sd)


class _BoomEverywhere:
    def state_dict(self):
        raise RuntimeError("boom everywhere")

    def load_state_dict(self, sd):
        pass


def check_async_call_fails_on_every_rank(ctx):
    """Every rank's async_save() raises (THREAD and PROCESS, dcpx's path and
    torch's writer): nobody waits for anybody, and the next saves work."""
    import torch.distributed.checkpoint as tdcp

    for i, kind in enumerate([dcpx.AsyncCheckpointerType.THREAD,
                              dcpx.AsyncCheckpointerType.PROCESS]):
        for foreign in (False, True):
            path = ctx.path("everywhere", f"{i}{int(foreign)}")
            w = {"storage_writer": tdcp.FileSystemWriter(path)} if foreign else {
                "checkpoint_id": path}
            with pytest.raises(RuntimeError, match="boom everywhere"):
                dcpx.async_save({"b": _BoomEverywhere(), "w": torch.ones(2)},
                                async_checkpointer_type=kind, **w)
    sd = {"w": full_value("ev.w", (8,)), "n": 3}
    for kind in (dcpx.AsyncCheckpointerType.THREAD, dcpx.AsyncCheckpointerType.PROCESS):
        path = ctx.path("everywhere", f"next_{kind.value}")
        dcpx.async_save(sd, checkpoint_id=path, async_checkpointer_type=kind).result(timeout=60)
        load_both(path, sd)


def check_abort_torch_save_warns_nothing(ctx):
    """The failing rank's side of a save torch's planner drives
    (_dist.abort_torch_save): the others raise its error, and it makes torch
    warn nothing (a planner of dcpx's, not the user's, so no "update your
    implementation" about set_up_planner's storage_meta)."""
    import warnings

    import torch.distributed.checkpoint as tdcp
    from dcpx.coordination import dist as _dist

    path = ctx.path("abort_torch")
    writer = tdcp.FileSystemWriter(path)
    if ctx.rank == 1:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="rank 1 cannot save"):
                _dist.abort_torch_save(None, RuntimeError("rank 1 cannot save"), writer)
        assert not [w for w in caught if "set_up_planner" in str(w.message)], [
            str(w.message) for w in caught]
    else:
        with pytest.raises(BaseException, match="rank 1 cannot save"):
            tdcp.save({"w": torch.ones(3)}, storage_writer=writer)
    assert not os.path.exists(os.path.join(path, ".metadata"))


def check_empty_and_value_only_ranks(ctx):
    """A rank with an empty state dict, or with non-tensor values only,
    beside one with tensors; then both empty; consecutive saves (the plan
    exchange by digest in between), loaded by both libraries."""
    import torch.distributed.checkpoint as tdcp

    r = ctx.rank
    cases = [
        {"w": full_value("e.w", (4, 4))} if r == 0 else {},
        {"w": full_value("e.w2", (4, 4))} if r == 0 else {},
        {"w": full_value("e.w3", (4, 4)), "n": 1} if r == 0 else {"n": 2, "s": "x"},
        {},
        {"w": full_value("e.w4", (2,))} if r == 1 else {},
    ]
    for saver in (dcpx, tdcp):
        for i, sd in enumerate(cases):
            path = ctx.path("empty", saver.__name__, str(i))
            saver.save(sd, checkpoint_id=path)
            if "n" in sd:
                # replicated key "n": one rank's value is kept, the same for both
                got_n = []
                for lib in (dcpx, tdcp):
                    d = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                         for k, v in sd.items()}
                    lib.load(d, checkpoint_id=path)
                    got_n.append(d.pop("n"))
                    _compare(d, {k: v for k, v in sd.items() if k != "n"}, path)
                assert got_n[0] == got_n[1] and got_n[0] in (1, 2), got_n
                everyone = [None] * WORLD
                dist.all_gather_object(everyone, got_n[0])
                assert everyone[0] == everyone[1], everyone
            else:
                load_both(path, sd)


CHECKS = [check_layouts_change_on_one_rank, check_replicated_value_differs_between_ranks,
          check_dtensor_reshard_both_libraries, check_per_rank_saves_both_libraries,
          check_group_of_rank_1_only, check_async_in_flight_one_fails_on_rank_1,
          check_async_fails_on_rank_1_per_rank_and_foreign_writer,
          check_async_staging_fails_on_rank_1_per_rank,
          check_async_call_fails_on_every_rank,
          check_abort_torch_save_warns_nothing,
          check_empty_and_value_only_ranks]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(WORLD, CHECKS, tmp_path_factory.mktemp("adversarial")).run()


@pytest.mark.dist
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_dist_adversarial(session, check):
    session.assert_ok(check)
