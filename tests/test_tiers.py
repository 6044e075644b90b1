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
from dcpx.manager.tiers import LocalTierFullError, Topology

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


def manager(rank: int, world: int, workdir: str, per_node: int = 2, root: str = "root", **kw):
    node = rank // per_node
    opts = dict(local_root=os.path.join(workdir, f"node{node}"), node=f"node{node}",
                replicas=1, persist_interval_steps=5, keep_local_k=2, keep_latest_k=3,
                tier_timeout_s=20)
    opts.update(kw)
    return dcpx.CheckpointManager(os.path.join(workdir, root), **opts)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


# ------------------------------------------------------------- child jobs

def train(rank: int, world: int, workdir: str, steps: int, kill_at_end: bool,
          kill_after_s: float = 0.0, step_s: float = 0.0) -> list:
    """Save every step; with ``kill_at_end`` every step is replicated before
    the next save (a known layout: no step skipped because replication fell
    behind) and every rank SIGKILLs itself once the last step is replicated
    everywhere (the job dies); with ``kill_after_s`` each rank is SIGKILLed
    at that moment, wherever its saves are."""
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
        if kill_at_end:
            m._tiers.wait_replicated()
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


def resume_each(rank: int, world: int, runs: list, earlier: tuple) -> tuple:
    """resume() in each of ``runs`` ((workdir, per_node, save_more)), one
    after the other in one job, then earlier_runs(*earlier): a spawn of 4
    interpreters costs more than the resumes."""
    mesh = _mesh(world)
    out = [resume(rank, world, w, per_node, more, mesh=mesh) for w, per_node, more in runs]
    return out, earlier_runs(rank, world, *earlier, mesh=mesh)


def earlier_runs(rank: int, world: int, workdir: str, trained: str, mesh) -> dict:
    """Run A (``trained``) left its steps in the node folders of ``workdir``
    (a copy of them).  Run B starts there without a load and saves steps 1-7
    with other values; its step 7 is only partly written (its pieces on node
    1 and their replicas on node 0 are gone) when node 1 brings back its
    folder of run A's step 7 (complete by itself: node 1's 2 pieces and node
    0's replicas).  Run C resumes; then a manager of another job (another
    root) that shares the local folders."""
    import torch.distributed as dist
    out: dict = {}
    m = manager(rank, world, workdir, persist_interval_steps=None)
    for step in range(1, 8):
        m.save(step, state(rank, world, step + 100, mesh))  # other values
        m._tiers.wait_replicated()
        if step == 1:
            out["after_first_save"] = m.local_steps()
            # the other rank of this node may not save step 2 before this
            # rank has looked (wait_replicated returns on each rank when its
            # own thread sees the round end)
            dist.barrier()
    m.close()
    dist.barrier()
    if rank == 0:
        work, old = Path(workdir), Path(trained)
        for key in os.listdir(work / "node1" / "step-7"):
            shutil.rmtree(work / "node1" / "step-7" / key)
        for key in os.listdir(work / "node0" / "step-7"):
            for p in ("rank-2-of-4", "rank-3-of-4"):
                shutil.rmtree(work / "node0" / "step-7" / key / p)
        for key in os.listdir(old / "node1" / "step-7"):
            shutil.copytree(old / "node1" / "step-7" / key, work / "node1" / "step-7" / key)
    dist.barrier()
    for run, root in (("C", "root"), ("another job", "other-root")):
        m = manager(rank, world, workdir, persist_interval_steps=None, root=root)
        sd = state(rank, world, 0, mesh, zero=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = m.load(sd)
        if got is not None:
            check_state(sd, rank, got + 100)  # run B's values, never run A's
        out[run] = {"step": got, "tier": (m.last_resume or {}).get("tier"),
                    "warnings": [str(w.message) for w in caught
                                 if issubclass(w.category, dcpx.manager.StepSkippedWarning)]}
        m.close()
    return out


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
    assert sorted(os.listdir(root)) == [pieces.JOB_FILE, "step-5"]  # and the job's id
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


def _damage_rank2_piece(work: Path) -> None:
    """A byte of rank 2's own piece of step 7 (on node 1) flipped inside a
    tensor's bytes; its replica on node 0 is intact."""
    (key,) = os.listdir(work / "node1" / "step-7")
    piece = work / "node1" / "step-7" / key / "rank-2-of-4"
    data = next(p for p in piece.iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    at = raw.find(value("rank2", 7).numpy().tobytes())
    assert at > 0
    raw[at + 20] ^= 0xFF
    data.write_bytes(bytes(raw))


#: scenario -> (what happens to the run's folders, steps saved after the resume)
SCENARIOS = {"intact": (None, 0), "lost node": (_lose_node1, 2), "both lost": (_lose_both, 0),
             "partly replicated": (_lose_node1_and_step7_replicas, 0),
             "corrupt piece": (_damage_rank2_piece, 0)}


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """Each scenario's copy of the run, resumed by 4 ranks, then the earlier
    runs' scenario (earlier_runs), in one job."""
    runs = []
    for name, (damage, more) in SCENARIOS.items():
        work = tmp_path_factory.mktemp("scenario") / "run"
        shutil.copytree(trained, work, symlinks=True)
        if damage is not None:
            damage(work)
        runs.append((str(work), 2, more))
    earlier = tmp_path_factory.mktemp("earlier") / "run"
    shutil.copytree(trained, earlier, symlinks=True)
    out = spawn(resume_each, 4, runs, (str(earlier), str(trained)))
    got = {name: [out[r][0][i] for r in range(4)] for i, name in enumerate(SCENARIOS)}
    got["earlier runs"] = [out[r][1] for r in range(4)]
    return got


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
def test_a_corrupt_local_piece_is_replaced_by_its_replica(resumed):
    """Rank 2's own piece of step 7 fails its CRC: rank 2 takes the replica
    node 0 holds, and every rank resumes step 7 (not step 6)."""
    out = resumed["corrupt piece"]
    assert [(o["step"], o["tier"]) for o in out] == [(7, "replica")] * 4, out
    assert all(o["warnings"] == [] for o in out), out


@pytest.mark.dist
def test_world_size_change_resumes_from_the_persistent_tier(edge):
    out = edge["world size change"]
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


@pytest.mark.dist
def test_stale_pieces_of_an_earlier_run_are_never_loaded(resumed):
    """A run that starts without a load removes the earlier run's steps at
    its first save."""
    assert [o["after_first_save"] for o in resumed["earlier runs"]] == [[1]] * 4


@pytest.mark.dist
def test_a_complete_step_of_an_earlier_run_is_never_loaded(resumed):
    """Run A's complete step 7, brought back beside run B's partly written
    step 7, is of a run B did not build on: run C resumes B's step 6 (its
    values checked) and says why it passed A's step 7 over; a manager of
    another job sharing the local folders loads nothing of them."""
    out = resumed["earlier runs"]
    assert [(o["C"]["step"], o["C"]["tier"]) for o in out] == [(6, "local")] * 4, out
    assert all(any("local step-7" in w and "does not build on" in w for w in o["C"]["warnings"])
               for o in out), out
    assert [o["another job"]["step"] for o in out] == [None] * 4, out


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
    t = m.tier_timings
    # persisted every 2 steps (a persistence that fell behind skips to the
    # newer step, and says so), 2 kept
    persisted = [s for s in (2, 4, 6) if t[s]["persistence"] == "done"]
    assert all(t[s]["persistence"].startswith("skipped") for s in {2, 4, 6} - set(persisted))
    assert 6 in persisted and m.all_steps() == persisted[-2:]
    assert m.local_steps() == [6, 7]      # keep_local_k
    assert m.step_metadata(6) == {"loss": 1.0 / 6}
    assert {"blocked_s", "waited_s", "local_s", "persisted_s", "local", "replication",
            "persistence"} <= set(t[6])
    # "replicated" (here: committed), or skipped because the thread was behind
    assert ("replicated_s" in t[6]) == (t[6]["replication"] == "done"), t[6]
    assert 0 <= t[6]["waited_s"] <= t[6]["blocked_s"] <= t[6]["local_s"] <= t[6]["persisted_s"]
    assert "persisted_s" not in t[7] and "persistence" not in t[7]
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
    """What the wire does between an Outgoing and an Incoming, in one
    process; ``flip``: (file number, offset) of a byte damaged on the way."""
    for i, (srcs, dsts) in enumerate(zip(out.views(), inc.views())):
        for src, dst in zip(srcs, dsts):
            dst[:] = src
        if flip is not None and flip[0] == i:
            dsts[0][flip[1]] ^= 0xFF


def test_a_piece_moves_bit_exact_and_damage_is_refused(tmp_path):
    """A replica is checked as it arrives, against the piece's own record
    CRCs: damage on the way, or at the source (the sender's file damaged
    after it committed: a CRC the sender computed while sending would match
    it), is refused before the replica commits."""
    m = _single(tmp_path)
    m.save(1, state(0, 1, 1))
    m.close()
    (step, key, rank, world), = pieces.scan(tmp_path / "local")
    piece = pieces.piece_dir(tmp_path / "local", step, key, rank, world)
    data = next(p for p in piece.iterdir() if p.name.endswith(".distcp"))
    at = data.read_bytes().find(value("shared", 1).numpy().tobytes()) + 100  # a tensor's bytes
    with pieces.Outgoing(piece) as out:
        index = pieces.decode_index(pieces.encode_index(out.index), "x")
        big = [n for n, _ in index].index(data.name)
        inc = pieces.Incoming(tmp_path / "bad" / "p", index, "the test's piece")
        _transfer(out, inc, flip=(big, at))
        with pytest.raises(dcpx.CorruptCheckpointError,
                           match="the test's piece: record 'shared': its bytes fail their CRC-32"):
            inc.commit()
        inc.close()
        assert not (tmp_path / "bad" / "p").exists() and os.listdir(tmp_path / "bad") == []
        inc = pieces.Incoming(tmp_path / "good" / "p", index, "the test's piece")
        _transfer(out, inc)
        inc.commit()
        inc.close()
    for name, *_ in index:
        assert (tmp_path / "good" / "p" / name).read_bytes() == (piece / name).read_bytes()
    sd = state(0, 1, 0, zero=True)
    dcpx.load(sd, checkpoint_id=tmp_path / "good" / "p", no_dist=True)
    check_state(sd, 0, 1)
    raw = bytearray(data.read_bytes())  # damaged at the source, after its commit
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pieces.Outgoing(piece) as out:
        inc = pieces.Incoming(tmp_path / "src" / "p", out.index, "the test's piece")
        _transfer(out, inc)
        with pytest.raises(dcpx.CorruptCheckpointError, match="record 'shared'.*CRC-32"):
            inc.commit()
        inc.close()


@pytest.mark.parametrize("index", [
    [["../../etc/passwd", 1], [".metadata", 1]],
    [[".metadata", -1]],
    [[".metadata", 1 << 60]],                  # more than any file
    [[".metadata", True]],
    [["__0_0.distcp", 1]],                     # no .metadata
    [[".metadata", 1], [".metadata", 1]],      # twice
    [[".metadata", 1]] + [[f"__{i}_0.distcp", 1] for i in range(5000)],  # too many
    {"a": 1},
])
def test_an_index_naming_anything_else_is_refused(index):
    import json
    with pytest.raises(dcpx.CorruptCheckpointError, match="index"):
        pieces.decode_index(json.dumps(index).encode(), "x")
    with pytest.raises(dcpx.CorruptCheckpointError, match="not JSON"):
        pieces.decode_index(b"{", "x")
    with pytest.raises(dcpx.CorruptCheckpointError, match="not JSON: RecursionError"):
        pieces.decode_index(b"[" * 100_000 + b"]" * 100_000, "x")


def test_no_room_for_a_replica_is_an_oserror_not_a_crash(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as e:
        pieces.Incoming(tmp_path / "x" / "p", [[".metadata", 100]], "x")
    assert pieces.is_enospc(e.value)
    assert os.listdir(tmp_path / "x") == []


def test_incomplete_set_is_not_a_candidate(tmp_path):
    """Pieces of two saves of one step (an earlier run's and a later run's)
    never make one step."""
    m = _single(tmp_path)
    tiers = m._tiers
    tiers.world = 2
    j = tiers.job
    k13, k12 = pieces.save_key(j, 1, None, 3), pieces.save_key(j, 1, None, 2)
    k21 = pieces.save_key(j, 2, (1, 2), 1)  # a later run, resumed from step 2
    held = [[(3, k13, 0, 2), (3, k21, 1, 2), (2, k12, 0, 2), (2, k12, 1, 2)], [(3, k13, 0, 2)]]
    got = tiers.candidates(held)
    assert [(s, k) for s, k, _ in got] == [(2, k12)]
    tiers.world = 1
    m.close()


# ------------------------------------- 2 ranks as 2 nodes: failures, peers
#
# One job of 2 processes (each a node) goes through the phases below, each
# with managers of its own (a phase that breaks the tier's groups leaves the
# next phase fresh ones); every phase's outcome is returned, so one failing
# phase fails its own test.

def _two(rank: int, workdir: str, sub: str, **kw):
    opts = dict(local_root=os.path.join(workdir, sub, f"node{rank}"), node=f"node{rank}",
                replicas=1, persist_interval_steps=None, keep_local_k=2, tier_timeout_s=3)
    opts.update(kw)
    return dcpx.CheckpointManager(os.path.join(workdir, sub, "root"), **opts)


def _sd(rank: int, step: int) -> dict:
    return {f"w{rank}": value(f"w{rank}", step), "shared": value("shared", step)}


def _error(fn) -> "str | None":
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the test looks at
        return f"{type(e).__name__}: {e}"
    return None


def _plain(timings: dict) -> dict:
    return {s: {k: v for k, v in t.items() if isinstance(v, (int, float, str))}
            for s, t in timings.items()}


def _phase_shared_folder(rank: int, workdir: str) -> dict:
    """Two node names, one folder: refused at construction."""
    refused = _error(lambda: dcpx.CheckpointManager(
        os.path.join(workdir, "shared", "root"), local_root=os.path.join(workdir, "shared", "one"),
        node=f"node{rank}", replicas=1, tier_timeout_s=3))
    return {"refused": refused}


def _drain(m) -> None:
    """Wait for the replication of every step saved (without raising: the
    test looks at what the next save() raises)."""
    import concurrent.futures
    t = m._tiers
    if hasattr(t, "_repl") and hasattr(t._repl, "drain"):
        t._repl.drain()
    else:  # the code before issue 29
        concurrent.futures.wait(list(t._repl_queue))


def _phase_local_save_fails(rank: int, workdir: str) -> dict:
    """Rank 1's asynchronous local save of step 2 fails with ENOSPC (its
    upload, after save() returned).  Each step's replication is waited for
    before the next save (no step skipped: a known outcome per step)."""
    import errno
    from concurrent.futures import Future
    m = _two(rank, workdir, "full", async_mode="async")
    real = dcpx.manager.tiers._async_save

    def failing(*a, **k):
        f: Future = Future()

        def later():
            time.sleep(0.3)
            f.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        threading.Thread(target=later, daemon=True).start()
        return f
    m.save(1, _sd(rank, 1))
    _drain(m)
    if rank == 1:
        dcpx.manager.tiers._async_save = failing
    m.save(2, _sd(rank, 2))
    dcpx.manager.tiers._async_save = real
    _drain(m)
    out = {"save3": _error(lambda: m.save(3, _sd(rank, 3)))}
    _drain(m)
    out["save4"] = _error(lambda: m.save(4, _sd(rank, 4)))
    out["close"] = _error(m.close)
    out["timings"] = _plain(m.tier_timings)
    return out


def _phase_hung_partner(rank: int, workdir: str) -> dict:
    """Rank 1's replication hangs (alive, not answering) longer than
    tier_timeout_s; rank 0 goes on training and saves again."""
    m = _two(rank, workdir, "hang", tier_timeout_s=2)
    if rank == 1:
        def stuck(*a, **k):
            time.sleep(5)
            return {}
        m._tiers._exchange = stuck
    m.save(1, _sd(rank, 1))
    out: dict = {}
    if rank == 0:
        time.sleep(4)
        t0 = time.monotonic()
        out["save2"] = _error(lambda: m.save(2, _sd(rank, 2)))
        out["blocked_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    _error(m.close)
    out["close_s"] = time.monotonic() - t0
    return out


def _lie_about_index_length(tiers, n: int) -> None:
    """Rank 0 announces a piece index of ``n`` bytes and sends a short one."""
    import torch.distributed as dist
    T = dcpx.manager.tiers
    if hasattr(T, "_Wire"):
        w = tiers.w_repl
        real = w.send

        def send(dst, kind, seq, payload=b""):
            if kind != T._PIECE:
                return real(dst, kind, seq, payload)
            head = T._HDR.pack(T._MAGIC, T._VERSION, kind, w.me, seq, n, 0).ljust(T._HEAD, b"\0")
            msg = torch.frombuffer(bytearray(head + bytes(payload)), dtype=torch.uint8)
            return [(w.group.send([msg], dst, 0), dst, "x"), msg]
        w.send = send
    else:  # before issue 31: the length went first, as a message of its own
        def post(out, dst):
            head = torch.tensor([n], dtype=torch.int64)
            return [dist.isend(head, tiers._g(dst), group=tiers.g_repl), head]
        tiers._post_piece = post


def _phase_hostile_sender(rank: int, workdir: str, how: str) -> dict:
    """Rank 0 misbehaves sending its piece of step 1 to rank 1 (``how``);
    rank 1 must get a CheckpointError naming rank 0, in bounded memory, and
    live on."""
    import resource
    m = _two(rank, workdir, f"hostile-{how}", tier_timeout_s=2)
    if rank == 0:
        if how == "more bytes":
            real = pieces.encode_index

            def short(index):  # each data file announced 100 bytes shorter than sent
                return real([[e[0], max(0, e[1] - 100)] + list(e[2:]) if e[0] != ".metadata"
                             else e for e in index])
            pieces.encode_index = short
        elif how == "deep index":
            pieces.encode_index = lambda index: b"[" * 100_000 + b"]" * 100_000
        else:
            _lie_about_index_length(m._tiers, {"2 GiB index": 2 << 30, "negative": -5}[how])
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m.save(1, _sd(rank, 1))
    out = {"wait": _error(m.wait)}
    out["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) / 1024
    _error(m.close)
    return out


def edge_cases(rank: int, world: int, workdir: str, trained: str) -> dict:
    import torch.distributed as dist
    real_encode = pieces.encode_index
    out: dict = {}
    phases = [("shared folder", _phase_shared_folder), ("local save fails", _phase_local_save_fails),
              ("hung partner", _phase_hung_partner)]
    phases += [(f"hostile: {how}", lambda r, w, how=how: _phase_hostile_sender(r, w, how))
               for how in ("more bytes", "2 GiB index", "negative", "deep index")]
    for name, phase in phases:
        try:
            out[name] = phase(rank, workdir)
        except BaseException as e:  # noqa: BLE001 - this phase's test reports it
            out[name] = {"crashed": f"{type(e).__name__}: {e}"}
        pieces.encode_index = real_encode
        dist.barrier()
    out["world size change"] = resume(rank, world, trained, 1)
    return out


@pytest.fixture(scope="module")
def edge(trained, tmp_path_factory):
    """The phases above, on 2 ranks as 2 nodes, in one job; and a copy of
    the 4-rank run resumed by 2 ranks."""
    work = tmp_path_factory.mktemp("edge")
    copy = tmp_path_factory.mktemp("resize") / "run"
    shutil.copytree(trained, copy, symlinks=True)
    outs = spawn_outcomes(edge_cases, 2, str(work), str(copy))
    got: dict = {}
    for o in outs:
        if not o.ok:  # a rank died (gloo aborted it, say): every phase fails with why
            got = {"died": o.describe()}
            break
        for name, res in o.value.items():
            got.setdefault(name, []).append(res)
    return got


def _phase(edge: dict, name: str) -> list:
    assert "died" not in edge, edge["died"]
    out = edge[name]
    for o in out:
        assert not (isinstance(o, dict) and "crashed" in o), out
    return out


@pytest.mark.dist
def test_two_node_names_sharing_one_folder_are_refused(edge):
    """A replica must never land on the node it protects."""
    for o in _phase(edge, "shared folder"):
        assert o["refused"] and "share one local folder" in o["refused"], o


@pytest.mark.dist
def test_an_asynchronous_local_save_failure_is_raised_at_the_next_save(edge):
    """Rank 1's step 2 fails after save() returned: its next save raises a
    LocalTierFullError naming step 2 (not two saves later); rank 0 goes on."""
    r0, r1 = _phase(edge, "local save fails")
    assert r1["save3"] and r1["save3"].startswith("LocalTierFullError") and \
        "step 2" in r1["save3"], r1
    assert r0["save3"] is None and r0["save4"] is None and r1["save4"] is None, (r0, r1)
    assert r0["close"] is None and r1["close"] is None, (r0, r1)


@pytest.mark.dist
def test_tier_timings_say_per_step_what_happened(edge):
    """Step 2 was never written on node 1 and step 3 not saved there (its
    save raised step 2's failure): on every rank neither counts as
    replicated, and the timings say why; step 4 is replicated."""
    for o in _phase(edge, "local save fails"):
        t = o["timings"]
        for step in (2, 3):
            assert "replicated_s" not in t[step], (step, t[step])
            assert "rank 1's local save failed" in t[step]["replication"], (step, t[step])
        assert t[4]["replication"] == "done" and "replicated_s" in t[4], t[4]
        assert t[1]["replication"] == "done", t[1]


@pytest.mark.dist
def test_a_hung_partner_is_named_in_a_checkpoint_error(edge):
    """Rank 1 stops answering: rank 0's next save raises a CheckpointError
    naming rank 1 and step 1, at once (it never waits for the replication),
    and close() is not held by the hung partner."""
    r0, _ = _phase(edge, "hung partner")
    assert r0["save2"] and r0["save2"].startswith("CheckpointError"), r0
    assert "rank 1" in r0["save2"] and "step 1" in r0["save2"], r0
    assert r0["blocked_s"] < 1.5 and r0["close_s"] < 1.5, r0


@pytest.mark.dist
@pytest.mark.parametrize("how", ["more bytes", "2 GiB index", "negative", "deep index"])
def test_a_misbehaving_peer_costs_a_checkpoint_error_not_the_rank(edge, how):
    """Rank 0 sends more bytes than its index says, announces an index of
    2 GiB or of -5 bytes, or sends an index nested 100,000 deep: rank 1
    raises a CheckpointError naming rank 0's piece, allocates nothing of
    it, and lives on (the job finishing is the proof)."""
    _, r1 = _phase(edge, f"hostile: {how}")
    assert r1["wait"] and r1["wait"].split(":")[0] in (
        "CheckpointError", "CorruptCheckpointError"), r1
    assert "rank 0" in r1["wait"], r1
    assert r1["grew_mib"] < 256, r1


# ------------------------------------------ scripts that end: the exit path

_SCRIPT = r"""
import os, sys, time
import torch, torch.distributed as dist
import dcpx
rank = int(os.environ["RANK"])
work, scenario = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
if scenario == "late":  # as on torch 2.4-2.6, which lack no_dist (a no-op there)
    dcpx.manager.tiers._torch_has_no_dist = lambda: False
held = None
m = dcpx.CheckpointManager(os.path.join(work, "root"), local_root=os.path.join(work, f"node{rank}"),
                           node=f"node{rank}", replicas=1, persist_interval_steps=3,
                           tier_timeout_s=60)
if scenario == "crash" and rank == 1:
    m._tiers._exchange = lambda *a, **k: time.sleep(60)  # alive, but never answers
for step in (1, 2, 3):
    if scenario == "localfail" and rank == 1 and step == 3:  # fails after save() returned
        import errno, threading
        from concurrent.futures import Future
        def failing(*a, **k):
            f = Future()
            def later():
                time.sleep(0.5)
                f.set_exception(OSError(errno.EIO, "Input/output error"))
            threading.Thread(target=later, daemon=True).start()
            return f
        dcpx.manager.tiers._async_save = failing
    if scenario == "late" and step == 3:  # the group is destroyed while it uploads
        import threading
        D = sys.modules["dcpx.coordination.dist"]
        entered, held = threading.Event(), threading.Event()
        def save_late(writer, *a, real=D.save, **k):
            if "step-3" in str(writer.path):  # (not step 2's, perhaps still uploading)
                entered.set()
                held.wait(30)
            return real(writer, *a, **k)
        D.save = save_late
    m.save(step, {f"w{rank}": torch.arange(1000.0) + step})
if scenario == "crash":
    if rank == 1:
        time.sleep(60)
    print(f"crashing at {time.time()}", flush=True)
    raise RuntimeError("the training step failed")
if held is not None:  # step 3's upload is in dcpx's dist save (where it goes there), or done
    while not (entered.wait(0.01) or m._tiers._last.upload.done()):
        pass
dist.destroy_process_group()  # as scripts end, and no close(): the tier's groups are its own
if held is not None:
    held.set()
print("returning without close()", flush=True)
"""


def _run_script(work: Path, scenario: str, wait_for: tuple, timeout: float) -> list:
    """The script above as 2 processes (each a node, a real interpreter exit);
    waits for the ranks ``wait_for`` (at most ``timeout`` s in all), then
    ends the others.  Returns per rank (exit status, or None when it was
    ended; the time.time() it ended at; its output)."""
    import subprocess
    import sys
    from dist_helpers import REPO, free_port
    script = work / "train.py"
    script.write_text(_SCRIPT)
    port = free_port()
    procs, logs, t0 = [], [], time.monotonic()
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        logs.append(open(work / f"rank{rank}.log", "wb"))
        procs.append(subprocess.Popen([sys.executable, str(script), str(work), scenario],
                                      stdout=logs[-1], stderr=subprocess.STDOUT, env=env))
    ended: list = [None, None]
    for i in wait_for:
        try:
            procs[i].wait(max(0.1, timeout - (time.monotonic() - t0)))
            ended[i] = time.time()
        except subprocess.TimeoutExpired:
            pass
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        p.wait()
        logs[i].close()
    return [(p.returncode if ended[i] is not None else None, ended[i],
             (work / f"rank{i}.log").read_text(errors="replace")) for i, p in enumerate(procs)]


@pytest.mark.dist
def test_the_last_persisting_save_lands_when_a_script_ends_without_close(tmp_path):
    """save(3) is due for persistence and the script destroys the process
    group and returns: at exit the tier finishes it, as the plain manager's
    last save lands (both ranks exit 0; step 3 is committed under root and
    loads)."""
    _the_last_save_landed(tmp_path, _run_script(tmp_path, "return", (0, 1), 120))


def _the_last_save_landed(tmp_path: Path, out: list) -> None:
    assert out[0][0] == 0 and out[1][0] == 0, out
    step = tmp_path / "root" / "step-3"
    assert (step / ".metadata").is_file(), (os.listdir(tmp_path / "root"), out)
    sd = {"w0": torch.zeros(1000), "w1": torch.zeros(1000)}
    dcpx.load(sd, checkpoint_id=step)
    assert sd["w0"].equal(torch.arange(1000.0) + 3) and sd["w1"].equal(torch.arange(1000.0) + 3)


@pytest.mark.dist
def test_a_local_save_still_uploading_when_the_group_is_destroyed_lands(tmp_path):
    """As above, with the group destroyed while step 3's local save uploads
    (held at dcpx's coordinated save, where it goes there), and the local
    saves made as on torch 2.4-2.6 (whose save lacks no_dist: a group of the
    rank alone besides): the upload makes no torch.distributed call, so step
    3 lands.  (On torch 2.4 this race failed the test above 2 times in 5:
    "Default process group has not been initialized" from the upload, then
    gloo aborted the process at exit.)"""
    _the_last_save_landed(tmp_path, _run_script(tmp_path, "late", (0, 1), 120))


@pytest.mark.dist
def test_a_last_local_save_failing_at_exit_still_takes_its_turns(tmp_path):
    """Rank 1's asynchronous local save of step 3 fails after save()
    returned, and the script returns: at exit rank 1 says so and still takes
    its turns in step 3's rounds, so neither rank is torn down inside gloo
    (both exit 0) and rank 0 is told why step 3 was not persisted (rank 1's
    failure, not a lost connection)."""
    out = _run_script(tmp_path, "localfail", (0, 1), 120)
    assert out[0][0] == 0 and out[1][0] == 0, out
    assert "the local save of step 3 failed" in out[1][2], out
    assert "rank 1: its local save of step 3 failed" in out[0][2], out
    assert "connection" not in out[0][2].lower(), out
    assert not (tmp_path / "root" / "step-3" / ".metadata").exists(), out


@pytest.mark.dist
def test_a_crashed_rank_never_waits_at_exit_for_a_hung_partner(tmp_path):
    """Rank 1 is alive but never answers (tier_timeout_s=60); rank 0's
    training raises: rank 0's interpreter exits at once, abandoning the
    step's replication (said on stderr), instead of waiting for rank 1."""
    out = _run_script(tmp_path, "crash", (0,), 150)
    status, ended, log = out[0]
    assert status == 1 and "the training step failed" in log and "abandoned" in log, out
    crashed = float(log.split("crashing at ")[1].split()[0])
    assert ended - crashed < 20, (ended - crashed, out)  # rank 1 answers in 60 s


def test_a_record_the_receiver_holds_is_neither_sent_nor_copied(tmp_path):
    """Data-parallel redundancy (issue 29, item 10): a tensor both ranks
    saved with the same bytes (a DDP weight) is not sent with the replica,
    nor copied: the replica keeps a hole there and names the receiver's own
    record (its ``.holes``), checked before the hole was accepted (same
    length, same archive digest).  Sent on (a resume's fetch), the replica
    is byte for byte the sender's piece.  A tensor of the same name with
    other bytes is sent."""
    mine, theirs = tmp_path / "rank-0-of-2", tmp_path / "rank-1-of-2"
    big = value("w", 3, 1 << 16)
    dcpx.save({"w": big, "same_name": value("a", 1), "own0": value("own0", 3)}, checkpoint_id=mine)
    dcpx.save({"w": big.clone(), "same_name": value("a", 2), "own1": value("own1", 3)},
              checkpoint_id=theirs)
    offered = pieces.offer(theirs, pieces.read_metadata(theirs))
    assert {e[0] for e in offered} == {"w", "same_name", "own1"}
    with pieces.Outgoing(mine) as out:
        skipped = out.skip_held(offered)
        index = pieces.decode_index(pieces.encode_index(out.index), "x", len(offered))
        holes = [h for e in index if len(e) > 2 for h in e[2]]
        assert [offered[h[2]][0] for h in holes] == ["w"] and skipped == holes[0][1]
        assert skipped > big.numel() * 4
        replica = tmp_path / "replica-of-0"
        inc = pieces.Incoming(replica, index, "the test's replica")
        _transfer(out, inc)
        assert inc.keep_holes(theirs, offered) == skipped
        inc.commit()
        inc.close()
    data = next(n for n, *_ in index if n.endswith(".distcp"))
    assert os.stat(replica / data).st_blocks * 512 < (mine / data).stat().st_size - skipped // 2
    with pieces.Outgoing(replica) as out:  # as a fetch sends it
        for (name, *_), views in zip(out.index, out.views()):
            assert b"".join(bytes(v) for v in views) == (mine / name).read_bytes(), name
    with pytest.raises(dcpx.CorruptCheckpointError, match="holes|index"):
        pieces.decode_index(pieces.encode_index(index), "x", 0)  # holes nobody offered
    shutil.rmtree(theirs)  # where the holes' bytes are: the replica cannot be sent whole
    with pytest.raises((dcpx.CorruptCheckpointError, OSError)):
        pieces.Outgoing(replica)
