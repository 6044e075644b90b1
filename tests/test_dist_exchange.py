"""The save's plan exchange by digest (dcpx/coordination/dist.py, docs/design.md "Plan
exchange by digest"): a rank whose plan is the one it sent last time on the
same group sends only its digest, the coordinator answers with a token for
the rank's share of the global plan, and anything that does not match goes
back to the whole exchange in the same save.

2 ranks (one spawn, a check per pytest test), each save followed by a load
with dcpx and with torch's dcp.load, bit-exact, on every rank:

* the same layout saved again (new values): every rank sends a digest and
  gets no index list back;
* a rank-local tensor whose shape changes, a key added on one rank only:
  that rank sends its plan, the other its digest, no extra round;
* a replicated tensor's shape, a non-tensor value's size, the nesting of the
  state dict (flatten mappings), a DTensor's placement: plans are sent;
* a value whose pickle keeps its size: digests, and the new value is saved;
* a new process group: plans are sent on it;
* the coordinator has forgotten the plans: it asks for them ("resend") and
  the save succeeds in one more round;
* ranks that disagree about a key: the save fails on every rank naming the
  key, nothing is committed, and the next save of the old layout succeeds;
* a tensor dcpx cannot save (a meta tensor) in place of one of the same
  signature: the save fails on every rank naming the key, though the plan
  went by digest and payloads are made only for the items a rank writes;
* async_save (its own group): digests from the second save on.

Without a process group: ``_coordinate`` answers an unknown digest with
"resend" and sends a rank's index list only when its token differs.
"""
from __future__ import annotations

import contextlib
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import dcpx
from conftest import assert_bit_equal
from dcpx.coordination import dist as _dist
from dist_helpers import CheckSession, dtensor_of, full_value

WORLD = 2


# --------------------------------------------------------------------------
# helpers (run on the ranks)


@contextlib.contextmanager
def recording():
    """Every object this rank passes to the save's gathers and gets from its
    scatters, in order."""
    log: dict = {"sent": [], "replies": []}
    gather, scatter = _dist._Group.gather, _dist._Group.scatter

    def rec_gather(self, obj):
        log["sent"].append(obj)
        return gather(self, obj)

    def rec_scatter(self, objs):
        out = scatter(self, objs)
        log["replies"].append(out)
        return out

    _dist._Group.gather, _dist._Group.scatter = rec_gather, rec_scatter
    try:
        yield log
    finally:
        _dist._Group.gather, _dist._Group.scatter = gather, scatter


def summary(log: dict) -> dict:
    """How this rank's save exchanged its plan."""
    first = log["sent"][0]
    resend = log["replies"][0][0] == "resend"
    final = log["replies"][1 if resend else 0]
    return {"sent": "digest" if first[1] is None else "plan", "resend": resend,
            "assignment_sent": final[2] is not None}


def state(rank: int, step: int, own_rows: int = 3, extra: bool = False,
          rep_rows: int = 6, cfg: str = "x", nested: bool = True,
          rep_b_dtype=torch.bfloat16, placement: str = "S0", group=None) -> dict:
    """Replicated tensors, a rank-local one, a DTensor sharded over the
    ranks, non-tensor values; values depend on ``step``."""
    from torch.distributed.device_mesh import DeviceMesh
    from dtensor_api import Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    sh = full_value(f"{step}.sh", (6, 4))
    sd = {
        "rep.a": full_value(f"{step}.rep.a", (rep_rows, 4)),
        "rep.b": full_value(f"{step}.rep.b", (5,), rep_b_dtype),
        f"own{rank}": full_value(f"{step}.own{rank}", (own_rows,)),
        "sh": dtensor_of(sh, mesh, [Shard(0 if placement == "S0" else 1)]),
        "step": step,
    }
    if nested:
        sd["cfg"] = {"name": cfg}
    else:
        sd["cfg.name"] = cfg
    if extra:
        sd[f"extra{rank}"] = full_value(f"{step}.extra{rank}", (7,))
    return sd


def zeros_like_state(sd: dict) -> dict:
    from dtensor_api import DTensor

    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, DTensor):
            out[k] = dtensor_of(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh,
                                v.placements)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_loaded(got: dict, exp: dict, what: str) -> None:
    from dtensor_api import DTensor

    for k, v in exp.items():
        if isinstance(v, dict):
            assert_loaded(got[k], v, f"{what}.{k}")
        elif isinstance(v, DTensor):
            assert_bit_equal(got[k].full_tensor(), v.full_tensor(), f"{what}.{k}")
        elif isinstance(v, torch.Tensor):
            assert_bit_equal(got[k], v, f"{what}.{k}")
        else:
            assert got[k] == v, f"{what}.{k}: {got[k]!r} != {v!r}"


def save_checked(path: str, sd: dict, group=None) -> list:
    """Save, load back with dcpx and with torch (bit-exact), and return every
    rank's summary of the exchange."""
    import torch.distributed.checkpoint as tdcp

    with recording() as log:
        dcpx.save(sd, checkpoint_id=path, process_group=group)
    mine = summary(log)
    for lib in (dcpx, tdcp):
        got = zeros_like_state(sd)
        lib.load(got, checkpoint_id=path, process_group=group)
        assert_loaded(got, sd, f"{lib.__name__} {path}")
    out = [None] * WORLD
    dist.all_gather_object(out, mine)
    return out


def expect(summaries: list, sent: list, resend: bool = False,
           assignment_sent: bool = None) -> None:
    assert [s["sent"] for s in summaries] == sent, summaries
    assert all(s["resend"] == resend for s in summaries), summaries
    if assignment_sent is not None:
        assert all(s["assignment_sent"] == assignment_sent for s in summaries), summaries


def fresh(ctx) -> None:
    """Every check starts with no plan sent or made."""
    clear = getattr(_dist, "clear_exchange_cache", None)
    if clear is not None:  # (a dcpx without the digest exchange fails at the checks' asserts)
        clear()
    # These checks are of the exchange by digest: no steady-state save
    # (tests/test_steady_state.py) in between.
    _dist.steady_state_enabled = False
    dist.barrier()


# --------------------------------------------------------------------------
# checks


def check_same_layout_sends_digests(ctx):
    fresh(ctx)
    r = ctx.rank
    expect(save_checked(ctx.path("same0"), state(r, 0)), ["plan", "plan"],
           assignment_sent=True)
    for step in (1, 2):
        expect(save_checked(ctx.path(f"same{step}"), state(r, step)), ["digest", "digest"],
               assignment_sent=False)


def check_changed_rank_sends_its_plan(ctx):
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("chg0"), state(r, 0))
    # rank 1's own tensor changes shape: only rank 1 sends its plan, and no
    # extra round is needed (the coordinator still has rank 0's)
    expect(save_checked(ctx.path("chg1"), state(r, 1, own_rows=3 + 5 * r)),
           ["digest", "plan"])
    expect(save_checked(ctx.path("chg2"), state(r, 2, own_rows=3 + 5 * r)),
           ["digest", "digest"])
    # a key added on rank 1 only
    expect(save_checked(ctx.path("chg3"), state(r, 3, own_rows=3 + 5 * r, extra=r == 1)),
           ["digest", "plan"])
    from dist_helpers import read_metadata
    md = read_metadata(ctx.path("chg3"))
    assert "extra1" in md.state_dict_metadata and "extra0" not in md.state_dict_metadata
    assert tuple(md.state_dict_metadata["own1"].size) == (8,)


def check_layout_changes_on_every_rank_send_plans(ctx):
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("lay0"), state(r, 0))
    expect(save_checked(ctx.path("lay1"), state(r, 1, rep_rows=9)), ["plan", "plan"])
    expect(save_checked(ctx.path("lay2"), state(r, 2, rep_rows=9)), ["digest", "digest"])
    # a non-tensor value whose pickle grows: its item's size changes (5,000
    # characters: torch.save pads a record, and on torch 2.4 a 50-character
    # string's file is as long as a 1-character one's)
    expect(save_checked(ctx.path("lay3"), state(r, 3, rep_rows=9, cfg="x" * 5000)),
           ["plan", "plan"])
    # a value of the same pickled size: the plan stands, the new value is saved
    expect(save_checked(ctx.path("lay4"), state(r, 4, rep_rows=9, cfg="y" * 5000)),
           ["digest", "digest"])
    # the same flat keys, another nesting: the flatten mappings differ
    expect(save_checked(ctx.path("lay5"), state(r, 5, rep_rows=9, cfg="y" * 5000, nested=False)),
           ["plan", "plan"])
    # a DTensor's placement: its chunk's offsets and sizes differ
    expect(save_checked(ctx.path("lay6"), state(r, 6, rep_rows=9, cfg="y" * 5000, nested=False,
                                                placement="S1")), ["plan", "plan"])


def check_new_group_sends_plans(ctx):
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("grp0"), state(r, 0))
    expect(save_checked(ctx.path("grp1"), state(r, 1)), ["digest", "digest"])
    pg = dist.new_group([0, 1])
    expect(save_checked(ctx.path("grp2"), state(r, 2, group=pg), group=pg), ["plan", "plan"])
    expect(save_checked(ctx.path("grp3"), state(r, 3, group=pg), group=pg),
           ["digest", "digest"])
    dist.destroy_process_group(pg)


def check_forgotten_plans_are_resent(ctx):
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("fgt0"), state(r, 0))
    dist.barrier()
    if r == 0:
        with _dist._global_plans_lock:
            _dist._GLOBAL_PLANS.clear()  # as if evicted by saves of other layouts
    dist.barrier()
    expect(save_checked(ctx.path("fgt1"), state(r, 1)), ["digest", "digest"], resend=True)
    expect(save_checked(ctx.path("fgt2"), state(r, 2)), ["digest", "digest"])
    # forgotten again, and rank 1's plan changed: rank 0 alone resends
    if r == 0:
        with _dist._global_plans_lock:
            _dist._GLOBAL_PLANS.clear()
    dist.barrier()
    with recording() as log:
        dcpx.save(state(r, 3, own_rows=3 + r), checkpoint_id=ctx.path("fgt3"))
    if log["replies"][0][0] != "resend":
        raise AssertionError(f"no resend: {log['replies'][0][:1]}")
    again = log["sent"][1]
    assert (again is not None) == (r == 0), (r, again is None)
    got = zeros_like_state(state(r, 3, own_rows=3 + r))
    dcpx.load(got, checkpoint_id=ctx.path("fgt3"))
    assert_loaded(got, state(r, 3, own_rows=3 + r), "fgt3")


def check_disagreeing_ranks_fail_then_recover(ctx):
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("dis0"), state(r, 0))
    expect(save_checked(ctx.path("dis1"), state(r, 1)), ["digest", "digest"])
    bad = state(r, 2, rep_b_dtype=torch.float16 if r == 1 else torch.bfloat16)
    with pytest.raises(Exception, match="rep.b"):
        dcpx.save(bad, checkpoint_id=ctx.path("dis2"))
    assert not os.path.exists(os.path.join(ctx.path("dis2"), ".metadata"))
    dist.barrier()
    expect(save_checked(ctx.path("dis3"), state(r, 3)), ["digest", "digest"])


def check_unsaveable_tensor_with_an_unchanged_plan(ctx):
    """With a digest, a rank makes only the payloads of the items it writes
    (after step 2): a tensor dcpx cannot save, with the signature of the one
    it replaces, still fails the save on every rank naming its key."""
    fresh(ctx)
    r = ctx.rank
    save_checked(ctx.path("uns0"), state(r, 0))
    bad = state(r, 1)
    bad["rep.a"] = torch.empty(bad["rep.a"].shape, dtype=bad["rep.a"].dtype, device="meta")
    with pytest.raises(Exception, match="rep.a"):
        dcpx.save(bad, checkpoint_id=ctx.path("uns1"))
    assert not os.path.exists(os.path.join(ctx.path("uns1"), ".metadata"))
    dist.barrier()
    expect(save_checked(ctx.path("uns2"), state(r, 2)), ["digest", "digest"])


def check_async_save_sends_digests(ctx):
    fresh(ctx)
    r = ctx.rank
    import torch.distributed.checkpoint as tdcp

    for step in range(3):
        sd = state(r, step)
        path = ctx.path(f"async{step}")
        with recording() as log:
            ret = dcpx.async_save(sd, checkpoint_id=path)
            fut = ret.upload_completion if isinstance(ret, dcpx.AsyncSaveResponse) else ret
            fut.result(timeout=60)
        s = summary(log)
        assert s["sent"] == ("plan" if step == 0 else "digest"), (step, s)
        assert not s["resend"], (step, s)
        dist.barrier()
        for lib in (dcpx, tdcp):
            got = zeros_like_state(sd)
            lib.load(got, checkpoint_id=path)
            assert_loaded(got, sd, f"{lib.__name__} {path}")


CHECKS = [check_same_layout_sends_digests, check_changed_rank_sends_its_plan,
          check_layout_changes_on_every_rank_send_plans, check_new_group_sends_plans,
          check_forgotten_plans_are_resent, check_disagreeing_ranks_fail_then_recover,
          check_unsaveable_tensor_with_an_unchanged_plan, check_async_save_sends_digests]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return CheckSession(WORLD, CHECKS, tmp_path_factory.mktemp("exchange")).run()


@pytest.mark.dist
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_plan_exchange(session, check):
    session.assert_ok(check)


# --------------------------------------------------------------------------
# the coordinator alone


def _items(n: int, rows: int = 4) -> list:
    return [_dist.LocalItem(f"p{i}", (0,), (rows,), (rows,), torch.float32, False, False,
                            4 * rows) for i in range(n)]


def test_coordinator_resends_unknown_digests_and_sends_assignments_by_token(tmp_path):
    _dist.clear_exchange_cache()
    blob = pickle.dumps((_items(6), {}), protocol=pickle.HIGHEST_PROTOCOL)
    digest = _dist._digest(blob)
    w = dcpx.FileSystemWriter(str(tmp_path / "c"))
    try:
        # a digest never sent whole: every rank is asked to resend
        plan, replies = _dist._coordinate(w, [("ok", None, "c", digest, None)] * 2)
        assert plan is None and replies == [("resend",)] * 2
        # whole plans: each rank gets its index list and its token
        plan, replies = _dist._coordinate(w, [("ok", blob, "c", digest, None)] * 2)
        assert [r[0] for r in replies] == ["ok", "ok"]
        assert sorted(i for r in replies for i in r[2]) == list(range(6))
        tokens = [r[3] for r in replies]
        # digests now, rank 0 holding its token, rank 1 an old one
        plan2, replies = _dist._coordinate(w, [("ok", None, "c", digest, tokens[0]),
                                               ("ok", None, "c", digest, b"old")])
        assert plan2 is plan
        assert replies[0][2] is None and replies[0][3] == tokens[0]
        assert replies[1][2] == plan.assign[1] and replies[1][3] == tokens[1]
        # a key added on one rank: the other's plan is known, no resend
        blob2 = pickle.dumps((_items(7), {}), protocol=pickle.HIGHEST_PROTOCOL)
        plan3, replies = _dist._coordinate(w, [("ok", None, "c", digest, tokens[0]),
                                               ("ok", blob2, "c", None, tokens[1])])
        assert plan3 is not plan and [r[0] for r in replies] == ["ok", "ok"]
        assert "p6" in plan3.state_dict_metadata
        assert [i for a in plan3.assign for i in a].count(6) == 1 and 6 in plan3.assign[1]
    finally:
        w._release_tag()
        _dist.clear_exchange_cache()
