"""dcpx.CheckpointManager and the CLI, adversarially: the directory states a
long job leaves behind (a newer step that is corrupt, a resume from an older
step, steps saved again out of order, torch-written steps, foreign folders,
interrupted deletions), and corrupt records whose damage zipfile reports as
something other than a bad archive.  No subprocess kills: each test builds
the state a crash or a bad disk would leave (docs/reliability.md,
dcpx/storage/commit.py) and checks what the manager and the CLI make of it.

Each test takes well under a second."""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpx
from dcpx.errors import CorruptCheckpointError
from dcpx.filesystem import check_zip_crcs
from dcpx.manager import CheckpointManager, StepSkippedWarning

def _state(step: int) -> dict:
    return {"w": torch.full((16, 16), float(step)), "b": torch.arange(20) + step, "step": step}


def _empty() -> dict:
    return _state(-1)


def _step_of(sd: dict) -> int:
    step = sd["step"]
    assert torch.equal(sd["w"], torch.full((16, 16), float(step)))
    assert torch.equal(sd["b"], torch.arange(20) + step)
    return step


def _data_file(step_dir: Path) -> Path:
    return next(p for p in step_dir.iterdir() if p.name.endswith(".distcp"))


def _truncate_data(step_dir: Path) -> None:
    f = _data_file(step_dir)
    f.write_bytes(f.read_bytes()[:50])


def _record(step_dir: Path, fqn: str):
    md = dcpx.FileSystemReader(step_dir).read_metadata()
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def _load_quietly(m: CheckpointManager, sd: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepSkippedWarning)
        return m.load(sd)


# ------------------------------------------ retention after a resume from an older step

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retention_keeps_step_just_saved_when_newer_step_is_corrupt(tmp_path, mode):
    """keep_latest_k=1; step-200 is committed but its data file is truncated.
    The resume falls back to step 100 and the job saves step 110.  The
    retention pass after that commit must keep 110: on main it kept only
    the newest step number (200, corrupt) and deleted 110 and 100, so the
    next restart found no step that loads."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(100, _state(100))
        m.save(200, _state(200))
    _truncate_data(tmp_path / "step-200")
    with CheckpointManager(tmp_path, keep_latest_k=1, async_mode=mode) as m:
        sd = _empty()
        with pytest.warns(StepSkippedWarning, match="step-200: its load failed"):
            assert m.load(sd) == 100
        assert _step_of(sd) == 100
        m.save(110, _state(110))
        m.wait()
        m.wait_for_retention()
        assert 110 in m.all_steps()
    sd = _empty()
    assert _load_quietly(CheckpointManager(tmp_path), sd) == 110  # the restart after a kill
    assert _step_of(sd) == 110
    assert sorted(os.listdir(tmp_path)) == ["step-110", "step-200"]


def test_retention_after_rollback_keeps_each_new_step_in_turn(tmp_path):
    """A rollback (load(step=100) with newer steps 200 and 300 still there),
    then saves every 10 steps with keep_latest_k=2: after each commit the
    step just saved survives and loads, the two newest step numbers are
    kept, and the older new-timeline steps go.  The job re-saves step 200
    (replacing the old one through the commit protocol; it loads with the
    new values), and step 210 then pushes it out."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        for s in (100, 200, 300):
            m.save(s, _state(s))
    with CheckpointManager(tmp_path, keep_latest_k=2, async_mode="async") as m:
        sd = _empty()
        assert m.load(sd, step=100) == 100
        for s in range(110, 220, 10):
            m.save(s, _state(s))
            m.wait()
            m.wait_for_retention()
            steps = m.all_steps()
            assert s in steps, (s, steps)
            assert steps[-2:] == [200, 300] or steps[-2:] == [s, 300]
            assert len(steps) <= 3, steps
            sd = _empty()
            assert m.load(sd, step=s) == s and _step_of(sd) == s
    # step 210 pushed the re-saved 200 out (the newest two step numbers: 210, 300)
    assert CheckpointManager(tmp_path).all_steps() == [210, 300]


# --------------------------------------- corrupt records that zipfile does not call "bad zip"

def _zip_bytes(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_check_zip_crcs_every_single_bit_flip_is_corrupt_or_harmless():
    """Every one-bit flip of a torch.save archive either passes testzip (a
    field zipfile ignores) or is a CorruptCheckpointError.  On main a flip
    in a header's compression method or version gave NotImplementedError,
    in its flags RuntimeError ('encrypted'), in the method to deflate
    zlib.error: not taken for corruption, so load raised instead of
    falling back, and the manager took it for the caller's error."""
    raw = _zip_bytes(200)
    others = []
    for pos in range(len(raw)):
        for bit in range(8):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            try:
                check_zip_crcs(bytes(b), "rec")
            except CorruptCheckpointError:
                pass
            except Exception as e:  # noqa: BLE001
                others.append((pos, bit, type(e).__name__))
    assert others == []


def _flips_that_zipfile_misreports(raw: bytes) -> list:
    """(pos, bit) flips of the archive for which zipfile raises something
    other than BadZipFile / ValueError / EOFError / OSError."""
    import zipfile
    found = []
    for pos in range(len(raw)):
        for bit in range(8):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            try:
                zipfile.ZipFile(io.BytesIO(bytes(b))).testzip()
            except (zipfile.BadZipFile, ValueError, EOFError, OSError):
                pass
            except Exception as e:  # noqa: BLE001
                found.append((pos, bit, type(e).__name__))
    return found



def _cli_names_the_damage(root: Path, data_file: Path, capsys) -> None:
    """verify, diff --values and convert of the damaged step-2: exit status
    1, one line naming the data file and the key, no traceback."""
    from dcpx.cli import main
    step2 = str(root / "step-2")
    out = root / "out.pt"
    for argv in (["verify", step2], ["diff", "--values", str(root / "step-1"), step2],
                 ["convert", step2, str(out)]):
        capsys.readouterr()
        assert main(argv) == 1, argv
        text = "".join(capsys.readouterr())
        assert f"{data_file}: key 'step': bad zip archive" in text, (argv, text)
        assert "Traceback" not in text
    assert not out.exists()


@pytest.mark.parametrize("writer", ["dcpx", "torch"])
@pytest.mark.parametrize("verify", ["commit", "full"])
def test_manager_falls_back_past_misreported_zip_flip(tmp_path, writer, verify, capsys):
    """The newest step's 'step' record (a torch.save archive) has one bit
    flipped where zipfile raises NotImplementedError / RuntimeError /
    zlib.error.  Both checks fall back to the older step with a warning;
    on main the default check raised the error from load (no fallback).
    The CLI says which file and key (on main: only 'NotImplementedError:
    That compression method is not supported')."""
    save = dcpx.save if writer == "dcpx" else dcp.save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "assuming the intent is to save in a single process"
        for s in (1, 2):
            save(_state(s), checkpoint_id=tmp_path / f"step-{s}")
    info = _record(tmp_path / "step-2", "step")
    f = tmp_path / "step-2" / info.relative_path
    orig = f.read_bytes()
    rec = orig[info.offset:info.offset + info.length]
    flips = _flips_that_zipfile_misreports(rec)
    kinds = {k for _, _, k in flips}
    assert {"NotImplementedError", "RuntimeError"} <= kinds, kinds
    picked = {}
    for pos, bit, kind in flips:
        picked.setdefault(kind, (pos, bit))
    for kind, (pos, bit) in sorted(picked.items()):
        b = bytearray(orig)
        b[info.offset + pos] ^= 1 << bit
        f.write_bytes(bytes(b))
        sd = _empty()
        with pytest.warns(StepSkippedWarning, match=r"step-2: .*(zip|CRC|problem)"):
            assert CheckpointManager(tmp_path, verify=verify).load(sd) == 1, kind
        assert _step_of(sd) == 1
        with pytest.raises(CorruptCheckpointError, match="bad zip archive"):
            dcpx.load(_empty(), checkpoint_id=tmp_path / "step-2")
        if verify == "full":  # the CLI on the same damage (once per writer and kind)
            _cli_names_the_damage(tmp_path, f, capsys)
    f.write_bytes(orig)


# ------------------------------------------------------------ what resume picks

def test_resume_ignores_foreign_folders_and_interrupted_deletions(tmp_path):
    """A root with a torch-written step, a dcpx-written one, a killed
    deletion of the newest step number (.deleting-step-N-*: never a step),
    an interrupted save of a newer step (no .metadata), a non-step folder
    holding a complete checkpoint, a stray file named like a step, and an
    empty step folder: resume loads the newest committed step, and a
    retention pass removes the interrupted deletion only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(10), checkpoint_id=tmp_path / "step-10")
    dcpx.save(_state(20), checkpoint_id=tmp_path / "step-20")
    dcpx.save(_state(99), checkpoint_id=tmp_path / "best")
    dcpx.save(_state(40), checkpoint_id=tmp_path / ".deleting-step-40-abcd1234")
    d = tmp_path / "step-50"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(_data_file(tmp_path / "step-20").read_bytes()[:100])
    (tmp_path / "step-60").mkdir()
    (tmp_path / "step-70").write_bytes(b"not a folder")
    m = CheckpointManager(tmp_path, keep_latest_k=5, async_mode="sync")
    assert m.all_steps() == [10, 20]
    sd = _empty()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m.load(sd) == 20
    skipped = sorted(str(w.message).split("skipped ")[1].split(":")[0] for w in caught
                     if issubclass(w.category, StepSkippedWarning))
    # newer, uncommitted: named, passed over (step-70, a file, is no step:
    # tests/test_tools_hostile.py::test_retention_ignores_non_folders_named_like_steps)
    assert skipped == ["step-50", "step-60"]
    assert _step_of(sd) == 20
    m.save(30, _state(30))
    m.close()
    names = sorted(os.listdir(tmp_path))
    assert not any(n.startswith(".deleting-") for n in names)
    assert {"best", "step-10", "step-20", "step-30", "step-50", "step-60", "step-70"} <= set(names)
    sd = _empty()
    assert _load_quietly(CheckpointManager(tmp_path), sd) == 30 and _step_of(sd) == 30
    sd = _empty()
    assert CheckpointManager(tmp_path).load(sd, step=10) == 10 and _step_of(sd) == 10


def test_resave_existing_step_interrupted_keeps_old_commit(tmp_path):
    """A restart re-saves step 20 (already committed); the save dies after
    writing its data file and before its commit (its tagged file and a dead
    save lock are what it leaves).  step-20 still loads the old values, and
    the next save of step 20 commits over it and removes the debris."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(10, _state(10))
        m.save(20, _state(20))
    d = tmp_path / "step-20"
    old = _data_file(d)
    (d / "__0_deadbeefdeadbeef_0.distcp").write_bytes(old.read_bytes()[:700])
    (d / ".dcpx.deadbeefdeadbeef.lock").write_bytes(b"")
    sd = _empty()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepSkippedWarning)
        assert CheckpointManager(tmp_path).load(sd) == 20
    assert _step_of(sd) == 20
    from dcpx.cli import main
    assert main(["verify", str(d)]) == 0  # the debris is not part of the checkpoint
    with CheckpointManager(tmp_path, async_mode="sync", verify="full") as m:
        state = _state(20)
        state["w"] += 0.5
        m.save(20, state)
        sd = _empty()
        assert m.load(sd) == 20
        assert torch.equal(sd["w"], state["w"])
    assert [p.name for p in d.iterdir() if p.name.endswith(".distcp")] == [_data_file(d).name]
    assert not (d / ".dcpx.deadbeefdeadbeef.lock").exists()


def test_verify_full_catches_any_flipped_byte_of_tensor_data(tmp_path):
    """verify='full' rejects a step whatever byte of its tensor payload is
    flipped (sampled positions in every record's data), and never loads
    wrong values: it falls back to the older step."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    d = tmp_path / "step-2"
    f = _data_file(d)
    orig = f.read_bytes()
    for fqn in ("w", "b"):
        info = _record(d, fqn)
        payload = _state(2)[fqn].numpy().tobytes()
        nbytes = len(payload)
        start = orig.find(payload, info.offset, info.offset + info.length)
        assert start >= 0
        for pos in range(start, start + nbytes, max(1, nbytes // 7)):
            b = bytearray(orig)
            b[pos] ^= 0x01
            f.write_bytes(bytes(b))
            for verify in ("commit", "full"):
                sd = _empty()
                with pytest.warns(StepSkippedWarning, match="step-2"):
                    assert CheckpointManager(tmp_path, verify=verify).load(sd) == 1
                assert _step_of(sd) == 1
    f.write_bytes(orig)
    sd = _empty()
    assert CheckpointManager(tmp_path, verify="full").load(sd) == 2 and _step_of(sd) == 2


def test_two_managers_one_root_never_lose_the_newest(tmp_path):
    """Two managers on one root with keep_latest_k=1, saving interleaved
    steps (and a plain dcpx.save of a step between them): after every
    commit and retention pass the newest committed step loads, and the step
    each manager just saved is kept until a newer one exists."""
    a = CheckpointManager(tmp_path, keep_latest_k=1, async_mode="async")
    b = CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync")
    try:
        for s in range(1, 13):
            if s % 3 == 0:
                dcpx.save(_state(s), checkpoint_id=tmp_path / f"step-{s}")
            else:
                (a if s % 2 else b).save(s, _state(s))
            a.wait()
            a.wait_for_retention()
            b.wait_for_retention()
            steps = a.all_steps()
            assert steps and steps[-1] == s, (s, steps)
            sd = _empty()
            with warnings.catch_warnings():
                warnings.simplefilter("error", StepSkippedWarning)
                assert a.load(sd) == s
            assert _step_of(sd) == s
    finally:
        a.close()
        b.close()


def test_retention_goes_on_past_newer_step_with_bad_metadata(tmp_path):
    """step-200's .metadata is garbage (committed by name, does not read).
    The resume falls back to 100 and the job saves 110, 120, 130 with
    keep_latest_k=2.  Retention used to delete nothing for good (the newest
    step number does not read back), so the disk filled over a long run;
    now it goes on, keeping step-200 (the newest number) and the step just
    saved, which loads."""
    with CheckpointManager(tmp_path, async_mode="sync") as m:
        m.save(100, _state(100))
    (tmp_path / "step-200").mkdir()
    (tmp_path / "step-200" / ".metadata").write_bytes(b"\x80\x04garbage")
    with CheckpointManager(tmp_path, keep_latest_k=2, async_mode="sync") as m:
        assert _load_quietly(m, _empty()) == 100
        for s in (110, 120, 130):
            m.save(s, _state(s))
            m.wait_for_retention()
            assert m.all_steps() == [s, 200]
    sd = _empty()
    assert _load_quietly(CheckpointManager(tmp_path), sd) == 130 and _step_of(sd) == 130
    # a fresh manager that saved nothing still deletes nothing past an unreadable newest step
    (tmp_path / "step-90").mkdir()
    dcpx.save(_state(90), checkpoint_id=tmp_path / "step-90")
    m = CheckpointManager(tmp_path, keep_latest_k=1)
    with pytest.warns(StepSkippedWarning, match="deletes nothing.*step 200"):
        assert m._apply_retention() == []
    assert m.all_steps() == [90, 130, 200]


# ------------------------------------------------------------------ dcpx ls of a live run

def _ls_json(root: Path, capsys) -> list:
    import json
    from dcpx.cli import main
    capsys.readouterr()
    rc = main(["ls", "--json", str(root)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_ls_does_not_list_a_deletion_in_progress(tmp_path, capsys):
    """`dcpx ls` on a run's root: a `.deleting-step-N-*` folder (the
    manager's deletion, cut off with its .metadata still there and its data
    file gone) was listed as a committed checkpoint; it is never one."""
    for s in (10, 20):
        dcpx.save(_state(s), checkpoint_id=tmp_path / f"step-{s}")
    half = tmp_path / ".deleting-step-5-abcd1234"
    dcpx.save(_state(5), checkpoint_id=half)
    _data_file(half).unlink()
    assert [r["name"] for r in _ls_json(tmp_path, capsys)] == ["step-10", "step-20"]


def test_ls_of_live_run_skips_step_renamed_away_meanwhile(tmp_path, monkeypatch, capsys):
    """A step that retention renames away between ls's listing of the root
    and its row made `dcpx ls` fail with exit status 2 ('No such file or
    directory'); now it is left out and ls succeeds."""
    from dcpx.cli import ls as cli_ls
    for s in (10, 20, 30):
        dcpx.save(_state(s), checkpoint_id=tmp_path / f"step-{s}")
    real_listdir = os.listdir
    gone = tmp_path / "step-20"

    def listdir(p="."):
        if Path(p) == gone and gone.exists():  # retention renames it right now
            os.rename(gone, tmp_path / ".deleting-step-20-00000000")
        return real_listdir(p)

    monkeypatch.setattr(cli_ls.os, "listdir", listdir)
    rows = _ls_json(tmp_path, capsys)
    assert [r["name"] for r in rows] == ["step-10", "step-30"]
    assert all(r["committed"] for r in rows)


# ------------------------------------------------------------- random root states

_KINDS = ("good", "torch", "trunc", "flip", "nomd", "garbage", "nodata", "empty")


def _make_step(root: Path, s: int, kind: str, rng) -> bool:
    """step-{s} in one of the states a crash, a bad disk or another writer
    leaves; True if it is intact (loads with step s's values)."""
    d = root / f"step-{s}"
    if kind == "empty":
        d.mkdir()
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (dcp.save if kind == "torch" else dcpx.save)(_state(s), checkpoint_id=d)
    f = _data_file(d)
    if kind == "trunc":
        f.write_bytes(f.read_bytes()[:rng.randrange(1, f.stat().st_size)])
    elif kind == "flip":
        info = _record(d, "w")
        raw = f.read_bytes()
        payload = _state(s)["w"].numpy().tobytes()
        i = raw.find(payload, info.offset)
        b = bytearray(raw)
        b[i + rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(b))
    elif kind == "nomd":
        (d / ".metadata").unlink()
    elif kind == "garbage":
        (d / ".metadata").write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(300))))
    elif kind == "nodata":
        f.unlink()
    return kind in ("good", "torch")


def test_random_root_states_resume_newest_intact_and_never_lose_it(tmp_path):
    """150 seeded roots of 1-5 steps, each intact (dcpx- or torch-written) or
    damaged (truncated or missing data file, a flipped tensor bit, no,
    garbage or empty .metadata, an empty folder).  load() returns the
    newest intact step with its values (CheckpointError only when no step
    is intact); the job then saves a step (new, or one of those numbers
    again) with keep_latest_k 1-3, and a restart loads an intact step with
    its values.  On main 26 of 200 such trials (seed 2) left no step that
    loads: retention deleted the step just saved below a damaged newer one."""
    import random
    rng = random.Random(20261124)
    for trial in range(150):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        steps = sorted(rng.sample(range(1, 50), rng.randrange(1, 6)))
        kinds = {s: rng.choice(_KINDS) for s in steps}
        good = {s for s in steps if _make_step(root, s, kinds[s], rng)}
        where = f"trial {trial}: {kinds}"
        m = CheckpointManager(root, async_mode=rng.choice(["sync", "async"]),
                              verify=rng.choice(["commit", "full"]),
                              keep_latest_k=rng.choice([1, 2, 3]))
        sd = _empty()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StepSkippedWarning)
            try:
                got = m.load(sd)
            except dcpx.CheckpointError:
                got = "none loads"
        if good:
            assert got == max(good), where
            assert _step_of(sd) == got
        else:
            assert got in (None, "none loads"), where
        start = got if isinstance(got, int) else 0
        nxt = rng.choice([start + rng.randrange(1, 30)] + steps)
        m.save(nxt, _state(nxt))
        m.close()
        sd = _empty()
        got = _load_quietly(CheckpointManager(root), sd)
        assert got in good | {nxt}, (where, nxt, sorted(os.listdir(root)))
        assert _step_of(sd) == got
