"""The node-local tier of dcpx.CheckpointManager (docs/tiers.md): pieces,
replicas on partner nodes, the persistent tier written from them, and
resume after a lost node.

Multi-rank tests run 4 ranks as 2 "nodes" of 2 ranks (gloo, one machine;
each node has its own local folder and ``node=`` name).  Every value a rank
saves is a function of (rank, step), so a resume checks bit-exactly that
every tensor comes from the step it reports, never from two steps mixed.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import dcpx
from dcpx.filesystem import pieces
from dcpx.tiers import LocalTierFullError, Topology

from dist_helpers import spawn, spawn_outcomes

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

#: random-kill trials in one test run (CI: 1; more: DCPX_TIER_TRIALS=20)
TRIALS = int(os.environ.get("DCPX_TIER_TRIALS", "1"))


# ------------------------------------------------------------------ values

def value(name: str, step: int, n: int = 48) -> torch.Tensor:
    """The deterministic value of ``name`` at ``step``: exact in float32."""
    seed = sum(ord(c) for c in name)
    return torch.arange(n, dtype=torch.float32) * (seed % 7 + 1) + step * 1000.0


def state(rank: int, world: int, step: int, mesh=None, zero: bool = False) -> dict:
    """A rank's state dict: a value every rank holds the same (a replicated
    parameter), the rank's own value, a row-sharded DTensor when a mesh is
    given, and a non-tensor value."""
    def v(name, n=48):
        t = value(name, step, n)
        return torch.zeros_like(t) if zero else t
    sd = {"shared": v("shared"), f"rank{rank}": v(f"rank{rank}"),
          "meta": {"step": -1 if zero else step, "rank": rank}}
    if mesh is not None:
        from dtensor_api import Shard, distribute_tensor
        full = v("dt", 64).reshape(16, 4)
        sd["dt"] = distribute_tensor(full, mesh, [Shard(0)])
    return sd


def check_state(sd: dict, rank: int, step: int, resharded: bool = False) -> None:
    want = state(rank, 0, step)
    assert sd["shared"].equal(want["shared"]), ("shared", step)
    assert sd[f"rank{rank}"].equal(want[f"rank{rank}"]), (f"rank{rank}", step)
    assert sd["meta"]["step"] == step
    if "dt" in sd:
        full = value("dt", step, 64).reshape(16, 4)
        local = sd["dt"].to_local()
        n = full.shape[0] // sd["dt"].device_mesh.size()
        r = sd["dt"].device_mesh.get_local_rank()
        assert local.equal(full[r * n:(r + 1) * n]), ("dt", step)


def manager(rank: int, world: int, workdir: str, per_node: int = 2, **kw):
    node = rank // per_node
    opts = dict(local_root=os.path.join(workdir, f"node{node}"), node=f"node{node}",
                replicas=1, persist_interval_steps=5, keep_local_k=2, keep_latest_k=3,
                tier_timeout_s=20)
    opts.update(kw)
    return dcpx.CheckpointManager(os.path.join(workdir, "root"), **opts)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


# ------------------------------------------------------------- child jobs

def train(rank: int, world: int, workdir: str, steps: int, kill_at_end: bool,
          kill_after_s: float = 0.0, step_s: float = 0.0) -> list:
    """Save every step; with ``kill_at_end`` every rank SIGKILLs itself once
    the last step is replicated everywhere (the job dies); with
    ``kill_after_s`` each rank is SIGKILLed at that moment, wherever its
    saves are."""
    import torch.distributed as dist
    if kill_after_s:
        def die():
            time.sleep(kill_after_s)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    mesh = _mesh(world)
    m = manager(rank, world, workdir)
    for step in range(1, steps + 1):
        sd = state(rank, world, step, mesh)
        resp = m.save(step, sd)
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
        if step_s:
            time.sleep(step_s)
    m._tiers.wait_replicated()
    if kill_at_end:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    m.close()
    return m.all_steps()


def resume(rank: int, world: int, workdir: str, per_node: int, save_more: int = 0,
           mesh=None) -> dict:
    mesh = mesh if mesh is not None else _mesh(world)
    m = manager(rank, world, workdir, per_node=per_node, replicas=1 if world > 2 else 0)
    sd = state(rank, world, 0, mesh, zero=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = m.load(sd)
    if got is not None:
        check_state(sd, rank, got)
    how = dict(m.last_resume or {})
    for step in range((got or 0) + 1, (got or 0) + 1 + save_more):  # training goes on
        m.save(step, state(rank, world, step, mesh))
    m.close()
    how["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, dcpx.manager.StepSkippedWarning)]
    how["local_steps"] = m.local_steps()
    return {"step": got, **how}


def resume_each(rank: int, world: int, runs: list) -> list:
    """resume() in each of ``runs`` ((workdir, per_node, save_more)), one
    after the other in one job: a spawn of 4 interpreters costs more than
    the resumes."""
    mesh = _mesh(world)
    return [resume(rank, world, w, per_node, more, mesh=mesh) for w, per_node, more in runs]


# --------------------------------------------------------- multi-rank tests

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 ranks, 2 nodes, 7 steps saved (every step local and replicated,
    step 5 persisted), then the whole job killed."""
    work = tmp_path_factory.mktemp("tiers") / "run"
    outs = spawn_outcomes(train, 4, str(work), 7, True)
    assert all(o.exitcode == -signal.SIGKILL for o in outs), [o.describe() for o in outs]
    return work


def _copy(trained: Path, tmp_path: Path) -> Path:
    work = tmp_path / "run"
    shutil.copytree(trained, work, symlinks=True)
    return work


@pytest.mark.dist
def test_layout_after_the_run(trained):
    root = trained / "root"
    assert sorted(os.listdir(root)) == ["step-5"]
    for node in (0, 1):
        listed = pieces.scan(trained / f"node{node}")
        steps = sorted({s for s, _, _, _ in listed})
        # keep_local_k=2; step 5 too if its persistence was still running at
        # the last retention (a step queued for persistence is kept)
        assert steps in ([6, 7], [5, 6, 7]), (node, steps)
        for s in (6, 7):
            ranks = sorted(r for st, _, r, _ in listed if st == s)
            assert ranks == [0, 1, 2, 3], (node, s, ranks)  # its own 2 + the 2 replicas


def _lose_node1(work: Path) -> None:
    shutil.rmtree(work / "node1")  # node 1 is replaced: its local storage is gone


def _lose_both(work: Path) -> None:
    shutil.rmtree(work / "node0")
    shutil.rmtree(work / "node1")


def _lose_node1_and_step7_replicas(work: Path) -> None:
    """Step 7's replicas on node 0 are gone (as if the job died while they
    were sent) and node 1 is lost: step 7 cannot be assembled, step 6 can."""
    shutil.rmtree(work / "node1")
    for key in os.listdir(work / "node0" / "step-7"):
        for p in ("rank-2-of-4", "rank-3-of-4"):
            shutil.rmtree(work / "node0" / "step-7" / key / p)


#: scenario -> (what happens to the run's folders, steps saved after the resume)
SCENARIOS = {"intact": (None, 0), "lost node": (_lose_node1, 2), "both lost": (_lose_both, 0),
             "partly replicated": (_lose_node1_and_step7_replicas, 0)}


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """Each scenario's copy of the run, resumed by 4 ranks (one job)."""
    runs = []
    for name, (damage, more) in SCENARIOS.items():
        work = tmp_path_factory.mktemp("scenario") / "run"
        shutil.copytree(trained, work, symlinks=True)
        if damage is not None:
            damage(work)
        runs.append((str(work), 2, more))
    out = spawn(resume_each, 4, runs)
    return {name: [out[r][i] for r in range(4)] for i, name in enumerate(SCENARIOS)}


@pytest.mark.dist
def test_lost_node_resumes_from_replicas(resumed):
    out = resumed["lost node"]
    assert [o["step"] for o in out] == [7] * 4
    assert all(o["tier"] == "replica" for o in out), out
    # the replaced node holds its ranks' pieces again, and the run goes on
    assert out[2]["local_steps"] == [8, 9]


@pytest.mark.dist
def test_intact_nodes_resume_locally(resumed):
    out = resumed["intact"]
    assert [(o["step"], o["tier"]) for o in out] == [(7, "local")] * 4


@pytest.mark.dist
def test_both_partners_lost_resume_from_the_persistent_tier(resumed):
    out = resumed["both lost"]
    assert [(o["step"], o["tier"]) for o in out] == [(5, "persistent")] * 4


@pytest.mark.dist
def test_partly_replicated_step_is_not_chosen(resumed):
    out = resumed["partly replicated"]
    assert [(o["step"], o["tier"]) for o in out] == [(6, "replica")] * 4
    assert 7 not in out[0]["local_steps"]  # a run never resumes onto it later


@pytest.mark.dist
def test_world_size_change_resumes_from_the_persistent_tier(trained, tmp_path):
    work = _copy(trained, tmp_path)
    out = spawn(resume, 2, str(work), 1)
    assert [(o["step"], o["tier"]) for o in out] == [(5, "persistent")] * 2


@pytest.mark.dist
def test_torch_dcp_loads_the_persistent_step(trained):
    """torch's own reader, one process: every rank's value, the replicated
    one (written once), the DTensor's rows from all four ranks."""
    import torch.distributed.checkpoint as tdcp
    sd = {"shared": torch.zeros(48), "dt": torch.zeros(16, 4), "meta": {"step": 0, "rank": 0}}
    sd.update({f"rank{r}": torch.zeros(48) for r in range(4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(sd, checkpoint_id=str(trained / "root" / "step-5"),
                  storage_reader=tdcp.FileSystemReader(str(trained / "root" / "step-5")))
    assert sd["shared"].equal(value("shared", 5))
    assert sd["dt"].equal(value("dt", 5, 64).reshape(16, 4))
    for r in range(4):
        assert sd[f"rank{r}"].equal(value(f"rank{r}", 5))
    md = tdcp.FileSystemReader(str(trained / "root" / "step-5")).read_metadata()
    # the replicated value is stored once, not by each of the 4 ranks
    assert len([k for k in md.storage_data if k.fqn == "shared"]) == 1


@pytest.mark.dist
def test_verify_passes_the_persistent_step(trained):
    from dcpx.cli.verify import verify_checkpoint
    import io
    assert verify_checkpoint(str(trained / "root" / "step-5"), out=io.StringIO()) == 0


@pytest.mark.dist
@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_at_a_random_moment_never_resumes_wrong(tmp_path, trial):
    """The job is killed at a random moment (in a local save, a replication,
    a persistence); a node may be lost too.  The resume loads one step,
    bit-exact on every rank (checked in resume()), or starts fresh."""
    rng = random.Random(1000 + trial)
    work = tmp_path / "run"
    outs = spawn_outcomes(train, 4, str(work), 10 ** 6, False,
                          kill_after_s=rng.uniform(2.0, 8.0), step_s=0.02)
    assert all(o.exitcode == -signal.SIGKILL for o in outs), [o.describe() for o in outs]
    lost = rng.choice([None, 0, 1])
    if lost is not None:
        shutil.rmtree(work / f"node{lost}", ignore_errors=True)
    out = spawn(resume, 4, str(work), 2, 1)
    assert len({o["step"] for o in out}) == 1, out
    assert len({o.get("tier") for o in out}) == 1, out


def stale_run(rank: int, world: int, workdir: str) -> dict:
    """A second run that starts fresh (no load) where an earlier run left
    steps 1-7: its first save removes them, so a resume never mixes runs."""
    mesh = _mesh(world)
    m = manager(rank, world, workdir, persist_interval_steps=None)
    for step in (1, 2):
        m.save(step, state(rank, world, step + 100, mesh))  # other values
    m.close()
    m = manager(rank, world, workdir, persist_interval_steps=None)
    sd = state(rank, world, 0, mesh, zero=True)
    got = m.load(sd)
    check_state(sd, rank, got + 100)
    return {"step": got, **(m.last_resume or {})}


@pytest.mark.dist
def test_stale_pieces_of_an_earlier_run_are_never_loaded(trained, tmp_path):
    work = _copy(trained, tmp_path)
    shutil.rmtree(work / "root")
    out = spawn(stale_run, 4, str(work))
    assert [(o["step"], o["tier"]) for o in out] == [(2, "local")] * 4


# ------------------------------------------------------ one process, units

def test_topology_partners_are_on_other_nodes():
    t = Topology(["a", "a", "b", "b", "c", "c"])
    t.check_replicas(2)
    for r in range(6):
        for k in (1, 2):
            p = t.partner(r, k)
            assert t.node_of[p] != t.node_of[r]
            assert t.source(p, k) == r
        assert t.partner(r, 1) != t.partner(r, 2)
    with pytest.raises(ValueError, match="needs at least 4 nodes"):
        t.check_replicas(3)
    with pytest.raises(ValueError, match="same number of ranks"):
        Topology(["a", "a", "b"]).check_replicas(1)


def test_replicas_need_other_nodes_single_process(tmp_path):
    with pytest.raises(ValueError, match="needs at least 2 nodes"):
        dcpx.CheckpointManager(tmp_path / "root", local_root=tmp_path / "local", replicas=1)
    with pytest.raises(ValueError, match="need a local_root"):
        dcpx.CheckpointManager(tmp_path / "root", persist_interval_steps=3)


def _single(tmp_path, **kw):
    opts = dict(local_root=tmp_path / "local", persist_interval_steps=2, keep_local_k=2)
    opts.update(kw)
    return dcpx.CheckpointManager(tmp_path / "root", **opts)


def test_single_process_tiers(tmp_path):
    m = _single(tmp_path, keep_latest_k=2)
    for step in range(1, 8):
        m.save(step, state(0, 1, step), metadata={"loss": 1.0 / step})
    m.wait()
    m.wait_for_retention()  # root's retention runs after each persistence, on its thread
    assert m.all_steps() == [4, 6]        # persisted every 2 steps, 2 kept
    assert m.local_steps() == [6, 7]      # keep_local_k
    assert m.step_metadata(6) == {"loss": 1.0 / 6}
    t = m.tier_timings
    assert set(t[6]) == {"blocked_s", "waited_s", "local_s", "replicated_s", "persisted_s"}
    assert 0 <= t[6]["waited_s"] <= t[6]["blocked_s"] <= t[6]["local_s"] <= t[6]["persisted_s"]
    assert "persisted_s" not in t[7]
    m.close()
    m = _single(tmp_path)
    sd = state(0, 1, 0, zero=True)
    assert m.load(sd) == 7 and m.last_resume["tier"] == "local"
    check_state(sd, 0, 7)
    sd = state(0, 1, 0, zero=True)
    assert m.load(sd, step=6) == 6
    check_state(sd, 0, 6)
    m.close()


def test_local_tier_loss_falls_back_to_root(tmp_path):
    m = _single(tmp_path)
    for step in range(1, 6):
        m.save(step, state(0, 1, step))
    m.close()
    shutil.rmtree(tmp_path / "local")
    m = _single(tmp_path)
    sd = state(0, 1, 0, zero=True)
    assert m.load(sd) == 4 and m.last_resume["tier"] == "persistent"
    check_state(sd, 0, 4)
    m.close()


def test_corrupt_local_piece_falls_back_with_a_warning(tmp_path):
    m = _single(tmp_path)
    for step in range(1, 6):
        m.save(step, state(0, 1, step))
    m.close()
    (_, key, _, _), = [p for p in pieces.scan(tmp_path / "local") if p[0] == 5]
    piece = pieces.piece_dir(tmp_path / "local", 5, key, 0, 1)
    data = next(p for p in piece.iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    at = raw.find(value("shared", 5).numpy().tobytes())  # a tensor's bytes, not padding
    assert at > 0
    raw[at + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    m = _single(tmp_path)
    sd = state(0, 1, 0, zero=True)
    with pytest.warns(dcpx.manager.StepSkippedWarning, match="local step-5"):
        got = m.load(sd)
    assert got == 4
    check_state(sd, 0, 4)
    m.close()


def test_newer_persistent_step_wins(tmp_path):
    """The local tier holds step 3 of an older run; root has step 6 (say a
    run elsewhere): the newest step is loaded."""
    m = _single(tmp_path, persist_interval_steps=None)
    for step in (1, 2, 3):
        m.save(step, state(0, 1, step))
    m.close()
    dcpx.CheckpointManager(tmp_path / "root", async_mode="sync").save(6, state(0, 1, 6))
    m = _single(tmp_path)
    sd = state(0, 1, 0, zero=True)
    assert m.load(sd) == 6 and m.last_resume["tier"] == "persistent"
    assert max(m.local_steps()) < 6  # older steps stay until retention; none is newer
    m.close()


def test_preemption_persists_the_final_step(tmp_path):
    m = _single(tmp_path, persist_interval_steps=100)
    m.save(1, state(0, 1, 1))
    m._on_signal(signal.SIGTERM, None)
    m.save(2, state(0, 1, 2))
    assert m.preempted and m.all_steps() == [2]
    m.close()


def test_explicit_persist(tmp_path):
    m = _single(tmp_path, persist_interval_steps=None)
    m.save(1, state(0, 1, 1))
    m.save(2, state(0, 1, 2), persist=True)
    m.wait()
    assert m.all_steps() == [2]
    m.close()


def test_sync_and_process_modes(tmp_path):
    for mode in ("sync", "process"):
        d = tmp_path / mode
        m = _single(d, async_mode=mode)
        for step in (1, 2):
            m.save(step, state(0, 1, step))
        m.close()
        m = _single(d)
        sd = state(0, 1, 0, zero=True)
        assert m.load(sd) == 2
        check_state(sd, 0, 2)
        assert m.all_steps() == [2]
        m.close()


def test_local_tier_full_is_a_clear_error(tmp_path, monkeypatch):
    m = _single(tmp_path)
    m.save(1, state(0, 1, 1))
    m._tiers.wait_replicated()
    monkeypatch.setattr(pieces, "free_bytes", lambda path: 10)
    with pytest.raises(LocalTierFullError, match=r"has 10 bytes free; a step needs \d+"):
        m.save(2, state(0, 1, 2))
    monkeypatch.undo()
    m.wait()  # step 2 is not persisted (its save raised why), and nothing else failed
    assert m.all_steps() == []
    m.save(3, state(0, 1, 3))
    m.close()
    assert m.local_steps()[-1] == 3


def test_local_tier_enospc_is_a_clear_error(tmp_path, monkeypatch):
    import errno
    m = _single(tmp_path, async_mode="sync")
    real = dcpx.manager.tiers._save

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "local"))
    monkeypatch.setattr(dcpx.manager.tiers, "_save", full)
    with pytest.raises(LocalTierFullError, match="is full"):
        m.save(1, state(0, 1, 1))
    monkeypatch.setattr(dcpx.manager.tiers, "_save", real)
    m.close()


def test_space_needed(tmp_path):
    m = _single(tmp_path)
    with pytest.raises(ValueError, match="nothing saved yet"):
        m.space_needed()
    got = m.space_needed(1000)
    assert got == {"local_per_node": 3000, "local_per_step_per_node": 1000,
                   "persistent_per_step_at_most": 1000}
    m.save(1, state(0, 1, 1))
    m.wait()
    piece = sum(f.stat().st_size for f in next((tmp_path / "local").glob("step-1/*/rank-0-of-1")).iterdir()
                if f.name == ".metadata" or f.name.endswith(".distcp"))
    assert m.space_needed()["local_per_step_per_node"] == piece
    m.close()
    with pytest.raises(ValueError, match="no local_root"):
        dcpx.CheckpointManager(tmp_path / "plain").space_needed(1)


def _transfer(out, inc, flip=None):
    """What the wire does between an Outgoing and an Incoming, in one process."""
    for i, (src, dst) in enumerate(zip(out.views(), inc.views())):
        if src is not None:
            dst[:] = src[:]
            if flip == i:
                dst[len(dst) // 2] ^= 0xFF


def test_a_piece_moves_bit_exact_and_damage_is_refused(tmp_path):
    m = _single(tmp_path)
    m.save(1, state(0, 1, 1))
    m.close()
    (step, key, rank, world), = pieces.scan(tmp_path / "local")
    piece = pieces.piece_dir(tmp_path / "local", step, key, rank, world)
    with pieces.Outgoing(piece) as out:
        index = pieces.decode_index(pieces.encode_index(out.index), "x")
        big = max(range(len(index)), key=lambda i: index[i][1])
        inc = pieces.Incoming(tmp_path / "bad" / "p", index, "the test's piece")
        _transfer(out, inc, flip=big)
        with pytest.raises(dcpx.CorruptCheckpointError, match="damaged in transfer"):
            inc.commit()
        inc.close()
        assert not (tmp_path / "bad" / "p").exists() and os.listdir(tmp_path / "bad") == []
        inc = pieces.Incoming(tmp_path / "good" / "p", index, "the test's piece")
        _transfer(out, inc)
        inc.commit()
        inc.close()
    for name, _, _ in index:
        assert (tmp_path / "good" / "p" / name).read_bytes() == (piece / name).read_bytes()
    sd = state(0, 1, 0, zero=True)
    dcpx.load(sd, checkpoint_id=tmp_path / "good" / "p", no_dist=True)
    check_state(sd, 0, 1)


@pytest.mark.parametrize("index", [
    [["../../etc/passwd", 1, 0], [".metadata", 1, 0]],
    [[".metadata", -1, 0]],
    [["__0_0.distcp", 1, 0]],                      # no .metadata
    [[".metadata", 1, 0], [".metadata", 1, 0]],    # twice
    {"a": 1},
])
def test_an_index_naming_anything_else_is_refused(index):
    import json
    with pytest.raises(dcpx.CorruptCheckpointError, match="index"):
        pieces.decode_index(json.dumps(index).encode(), "x")
    with pytest.raises(dcpx.CorruptCheckpointError, match="not JSON"):
        pieces.decode_index(b"{", "x")


def test_no_room_for_a_replica_is_an_oserror_not_a_crash(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as e:
        pieces.Incoming(tmp_path / "x" / "p", [[".metadata", 100, 0]], "x")
    assert pieces.is_enospc(e.value)
    assert os.listdir(tmp_path / "x") == []


def test_incomplete_set_is_not_a_candidate(tmp_path):
    """Pieces of two saves of one step (an earlier run's and a later run's)
    never make one step."""
    m = _single(tmp_path)
    tiers = m._tiers
    tiers.world = 2
    held = [[(3, "r1-s3", 0, 2), (3, "r2-s1", 1, 2), (2, "r1-s2", 0, 2), (2, "r1-s2", 1, 2)],
            [(3, "r1-s3", 0, 2)]]
    got = tiers.candidates(held)
    assert [(s, k) for s, k, _ in got] == [(2, "r1-s2")]
    tiers.world = 1
    m.close()
