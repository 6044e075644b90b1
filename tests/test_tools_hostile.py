"""The tools around a checkpoint (convert, diff, the manager's retention,
``dcpx ls``) and load hold the same line as load on odd or hostile input
(issue 21): overlapping or non-covering chunks, torch.save records shorter
than their pickle claims, hostile Hugging Face folders, non-step entries in
a manager's root, integer tolerances."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import dcpx
from dcpx.formats import chunks as _chunks
from dcpx.formats.metadata import METADATA_FN
from dcpx.cli import main
from dcpx.errors import CorruptCheckpointError
from conftest import torch_save_supports


def _cli(*argv) -> int:
    return main([str(a) for a in argv])


# -- 2. overlapping / non-covering chunks -----------------------------------------

def _chunked(path: Path, pieces: list, size: tuple, first: str = "") -> None:
    """A DCP checkpoint at ``path`` whose key "w" of ``size`` is saved as the
    chunks ``pieces`` ((offset, value, file)), each a 1-D run of ``value``
    in its own data file (file 0 or 1); with ``first``, a key of that name
    saved in file 1 comes before "w" in the state dict."""
    path.mkdir()
    storage, chunks, sdm = {}, [], {}
    for n, (off, value, fidx) in enumerate(pieces):
        one = path.parent / f"_piece{n}"
        dcpx.save({"p": torch.full((4,), float(value))}, checkpoint_id=one)
        md = pickle.loads((one / METADATA_FN).read_bytes())
        (info,) = md.storage_data.values()
        name = f"__{fidx}_{n}.distcp"
        shutil.copy(one / info.relative_path, path / name)
        shutil.rmtree(one)
        info.relative_path = name
        ch = ChunkStorageMetadata(offsets=torch.Size([off]), sizes=torch.Size([4]))
        chunks.append(ch)
        storage[MetadataIndex("w", ch.offsets)] = info
        if first and fidx == 1 and first not in sdm:
            sdm[first] = TensorStorageMetadata(md.state_dict_metadata["p"].properties,
                                               torch.Size([4]), [ChunkStorageMetadata(
                                                   torch.Size([0]), torch.Size([4]))])
            storage[MetadataIndex(first, torch.Size([0]))] = info
    props = TensorStorageMetadata(md.state_dict_metadata["p"].properties, torch.Size(size), [])
    sdm["w"] = TensorStorageMetadata(props.properties, torch.Size(size), chunks)
    (path / METADATA_FN).write_bytes(pickle.dumps(Metadata(state_dict_metadata=sdm,
                                                           storage_data=storage)))


def test_tiling_finds_overlaps_and_gaps():
    B = _chunks.Box
    assert _chunks.tiling_problem((8,), [B((0,), (4,)), B((4,), (4,))]) is None
    grid = [B((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    assert _chunks.tiling_problem((4, 4), grid) is None
    t = _chunks.tiling((8,), [B((0,), (4,)), B((2,), (4,))])   # same count, overlap + gap
    assert "overlap" in t.overlap and "(6,)" in t.gap
    assert "overlap" in _chunks.tiling_problem((4, 4), grid + [B((1, 1), (2, 2))])
    assert "(2, 2)" in _chunks.tiling_problem((4, 4), grid[:3])
    # a staggered layout (blocks of several grid cells)
    stag = [B((0, 0), (2, 3)), B((0, 3), (2, 1)), B((2, 0), (2, 1)), B((2, 1), (2, 3))]
    assert _chunks.tiling_problem((4, 4), stag) is None
    assert "overlap" in _chunks.tiling_problem((4, 4), stag[:3] + [B((1, 1), (3, 3))])
    assert "outside" in _chunks.tiling_problem((4,), [B((2,), (4,))])
    assert "overlap" in _chunks.tiling_problem((), [B((), ()), B((), ())])


@pytest.mark.parametrize("shape", [(10,), (5, 6), (3, 4, 2)])
def test_tiling_agrees_with_counting_every_element(shape):
    import random
    rng = random.Random(21)
    for _ in range(400):
        boxes = []
        for _ in range(rng.randint(1, 6)):
            off = tuple(rng.randint(0, s - 1) for s in shape)
            boxes.append(_chunks.Box(off, tuple(rng.randint(0, s - o) for o, s in zip(off, shape))))
        count = torch.zeros(shape, dtype=torch.int64)
        for b in boxes:
            count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] += 1
        t = _chunks.tiling(shape, boxes)
        assert (t.overlap is not None) == bool((count > 1).any()), boxes
        assert (t.gap is not None) == bool((count == 0).any()), boxes


def test_convert_and_diff_refuse_overlap_with_a_gap(tmp_path, capsys):
    """Chunks [0,4) and [2,6) of an 8-element tensor: as many elements as the
    tensor holds, but two overlap and [6,8) is held by none.  On main,
    convert wrote the uninitialised [6,8) and ``diff A A --values`` found a
    difference with itself."""
    ck = tmp_path / "ck"
    _chunked(ck, [(0, 1, 0), (2, 2, 0)], (8,))
    assert _cli("convert", ck, tmp_path / "out.pt") == 1
    err = capsys.readouterr().err
    assert "'w'" in err and "overlap" in err
    assert not (tmp_path / "out.pt").exists()
    assert _cli("diff", ck, ck, "--values") == 1
    assert "'w'" in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError, match="'w'.*overlap"):
        dcpx.FileSystemReader(ck).read_key("w", dcpx.FileSystemReader(ck).read_metadata())


def test_load_refuses_a_gap_hidden_by_an_overlap(tmp_path):
    ck = tmp_path / "ck"
    _chunked(ck, [(0, 1, 0), (2, 2, 0)], (8,))
    with pytest.raises(CorruptCheckpointError, match="'w'.*cover"):
        dcpx.load({"w": torch.zeros(8)}, checkpoint_id=ck)


@pytest.mark.parametrize("pieces,first", [
    ([(2, 2, 0), (0, 1, 0)], ""),          # metadata order is not torch's order
    ([(0, 1, 0), (2, 2, 1)], ""),          # two files
    ([(0, 1, 0), (2, 2, 1)], "x"),         # file 1 first seen in an earlier key
    ([(2, 2, 1), (0, 1, 0), (1, 3, 1)], "x"),
])
def test_load_applies_overlapping_chunks_in_torchs_order(tmp_path, pieces, first):
    ck = tmp_path / "ck"
    _chunked(ck, pieces, (6,), first)
    def sd():
        out = {first: torch.zeros(4)} if first else {}
        out["w"] = torch.zeros(6)
        return out
    want, got = sd(), sd()
    tdcp.load(want, checkpoint_id=str(ck))
    dcpx.load(got, checkpoint_id=ck)
    assert got["w"].tolist() == want["w"].tolist()


# -- 3. torch.save records shorter than their pickle claims ---------------------

def _short_record(src: Path, dst: Path, record: str, keep: int) -> None:
    """``src`` (a torch.save zip) rewritten with ``record`` cut to ``keep``
    bytes, every other record as it was (stored, as torch writes them)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/" + record):
                data = data[:keep]
            zout.writestr(info.filename, data)


def test_convert_refuses_a_record_shorter_than_its_pickle_claims(tmp_path, capsys):
    src = tmp_path / "ok.pt"
    torch.save({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(64)}, src)
    bad = tmp_path / "bad.pt"
    _short_record(src, bad, "data/0", 16)
    # torch.load >= 2.9 refuses it; torch 2.4-2.8 load the 256 bytes from
    # the record's start, past its end into the zip's next bytes.
    assert _cli("convert", bad, tmp_path / "out.safetensors") == 1
    err = capsys.readouterr().err
    assert "data/0" in err and "16 bytes" in err and "256" in err
    assert not (tmp_path / "out.safetensors").exists()
    # the same file with its record whole converts
    good = tmp_path / "good.pt"
    _short_record(src, good, "data/0", 1 << 20)
    assert _cli("convert", good, tmp_path / "out.safetensors") == 0


class _Holder:   # pickled with NEWOBJ (copyreg.__newobj__) and BUILD
    def __init__(self, t):
        self.t = t


def test_record_check_walks_newobj_without_running_it(tmp_path):
    from dcpx.cli._common import CliError, check_torch_records
    src = tmp_path / "ok.pt"
    torch.save({"h": _Holder(torch.arange(64, dtype=torch.float32))}, src)
    assert b"\x81" in zipfile.ZipFile(src).read("ok/data.pkl")   # NEWOBJ
    bad = tmp_path / "bad.pt"
    _short_record(src, bad, "data/0", 16)
    check_torch_records(src)
    with pytest.raises(CliError, match=r"data/0 is 16 bytes, its pickle says 256"):
        check_torch_records(bad)


def _ordered_state(kind: str):
    if kind == "state_dict":   # an OrderedDict with a _metadata attribute
        torch.manual_seed(0)
        return torch.nn.Linear(8, 8).state_dict()
    import collections
    d = collections.OrderedDict(a=torch.arange(64, dtype=torch.float32), b=torch.ones(64))
    return {"model": d, "groups": [collections.OrderedDict(lr=torch.zeros(2))]} \
        if kind == "nested" else d


@pytest.mark.parametrize("kind", ["OrderedDict", "state_dict", "nested"])
def test_convert_refuses_a_short_record_under_an_ordered_dict(tmp_path, capsys, kind):
    # On main the record check gave up on a pickle that calls __setitem__ on
    # (or __setstate__s) a global's result, as an OrderedDict's pickle does:
    # the truncated record went on to torch.load (torch 2.4-2.8 read past it).
    src = tmp_path / "ok.pt"
    sd = _ordered_state(kind)
    torch.save(sd, src)
    first = next(iter(sd.values())) if kind != "nested" else sd["model"]["a"]
    need = first.numel() * first.element_size()
    bad = tmp_path / "bad.pt"
    _short_record(src, bad, "data/0", 16)
    assert _cli("convert", bad, tmp_path / "out.safetensors") == 1
    err = capsys.readouterr().err
    assert "data/0" in err and "16 bytes" in err and f"says {need}" in err, err
    assert not (tmp_path / "out.safetensors").exists()
    good = tmp_path / "good.pt"
    _short_record(src, good, "data/0", 1 << 20)
    assert _cli("convert", good, tmp_path / "out.safetensors") == 0


# -- 4. hostile Hugging Face folders ------------------------------------------

def _hf_folder(tmp_path: Path, weight_map) -> Path:
    st = pytest.importorskip("safetensors.torch")
    d = tmp_path / "hf"
    d.mkdir()
    st.save_file({"w": torch.ones(4)}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABS"])
def test_convert_refuses_shards_outside_the_folder(tmp_path, capsys, where):
    st = pytest.importorskip("safetensors.torch")
    outside = tmp_path / "outside.safetensors"
    st.save_file({"secret": torch.ones(2)}, str(outside))
    name = str(outside) if where == "ABS" else where
    d = _hf_folder(tmp_path, {"w": "model-00001-of-00001.safetensors", "secret": name})
    assert _cli("convert", d, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "outside its folder" in err and repr(name) in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_fifo_shard_without_hanging(tmp_path, capsys):
    d = _hf_folder(tmp_path, {"w": "model-00001-of-00001.safetensors", "v": "pipe.safetensors"})
    os.mkfifo(d / "pipe.safetensors")
    assert _cli("convert", d, tmp_path / "out") == 1      # on main: blocks for ever
    assert "a FIFO" in capsys.readouterr().err
    os.mkfifo(tmp_path / "lone.safetensors")
    assert _cli("convert", tmp_path / "lone.safetensors", tmp_path / "out2") == 1
    assert "a FIFO" in capsys.readouterr().err


def test_convert_list_valued_weight_map_is_a_clear_error(tmp_path, capsys):
    d = _hf_folder(tmp_path, {"w": ["model-00001-of-00001.safetensors"]})
    assert _cli("convert", d, tmp_path / "out") == 1
    assert "weight_map['w'] is a list" in capsys.readouterr().err
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    assert _cli("convert", d, tmp_path / "out") == 1
    assert "weight_map is a list" in capsys.readouterr().err


def test_convert_refuses_a_tensor_named_metadata_for_safetensors(tmp_path, capsys):
    pytest.importorskip("safetensors")
    src = tmp_path / "m.pt"
    torch.save({"__metadata__": torch.ones(2), "w": torch.ones(2)}, src)
    assert _cli("convert", src, tmp_path / "out.safetensors") == 1
    assert "'__metadata__'" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
    assert _cli("convert", src, tmp_path / "out_dcp") == 0    # DCP holds any key


# -- 5. / 7. what a step is: retention and dcpx ls ----------------------------

def test_retention_ignores_non_folders_named_like_steps(tmp_path):
    """A file, a FIFO and a link loop named like steps: on main each pass
    warned (RuntimeWarning) and deleted nothing, so the disk filled."""
    import warnings
    (tmp_path / "step-1").write_text("not a step")
    os.mkfifo(tmp_path / "step-2")
    os.symlink("step-3", tmp_path / "step-3")                  # a link loop
    sd = {"w": torch.ones(4)}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with dcpx.CheckpointManager(tmp_path, keep_latest_k=1, async_mode="sync") as m:
            for step in (10, 11, 12, 13):
                m.save(step, sd)
                m.wait_for_retention()
            assert m.all_steps() == [13]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-13", "step-2", "step-3"]
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert not [x for x in msgs if "retention" in x and "failed" in x]
    for name in ("step-1", "step-2", "step-3"):                # said once each
        assert sum(name in x and "not a folder" in x for x in msgs) == 1, msgs


def test_ls_and_manager_agree_on_a_symlinked_step(tmp_path, capsys):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    dcpx.save({"w": torch.ones(4)}, checkpoint_id=elsewhere / "step-7")
    os.symlink(elsewhere / "step-7", root / "step-7")
    (root / "step-8").write_text("")                           # not a step
    m = dcpx.CheckpointManager(root, async_mode="sync")
    assert m.all_steps() == [7]
    assert _cli("ls", root, "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [7]                    # on main: []
    m.close()


def test_retention_deletes_a_symlinked_step_as_a_link(tmp_path):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    dcpx.save({"w": torch.ones(4)}, checkpoint_id=elsewhere / "step-1")
    os.symlink(elsewhere / "step-1", root / "step-1")
    with dcpx.CheckpointManager(root, keep_latest_k=1, async_mode="sync") as m:
        m.save(2, {"w": torch.ones(4)})
        m.wait_for_retention()
        assert m.all_steps() == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]   # no .deleting- leftover
    assert (elsewhere / "step-1" / METADATA_FN).exists()          # the link's target stays


# -- 7. diff tolerances on 64-bit integers --------------------------------------

@pytest.mark.parametrize("dtype,x,y", [
    (torch.int64, 2**53 + 1, 2**53),
    (torch.int64, -(2**63), -(2**63) + 1),
    (torch.uint64, 2**64 - 1, 2**64 - 2),
])
def test_diff_tolerance_compares_64_bit_integers_exactly(tmp_path, capsys, dtype, x, y):
    if not torch_save_supports(dtype):
        pytest.skip(f"torch {torch.__version__}'s torch.save has no {dtype}")
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"n": torch.tensor([x, 5], dtype=dtype)}, a)
    torch.save({"n": torch.tensor([y, 5], dtype=dtype)}, b)
    assert _cli("diff", a, b, "--atol", "0.5") == 1      # on main: 0 (equal in float64)
    assert "1 of 2 elements outside" in capsys.readouterr().out
    assert _cli("diff", a, b, "--atol", "1") == 0
    assert _cli("diff", a, b, "--rtol", "1e-30") == 1


# -- 1. the many-chunks shape of the fuzzer -------------------------------------

def test_many_chunks_shapes_decode_alike_both_ways():
    """fuzz/many_chunks.py's layouts (a few seeds, small counts, not timed):
    the C index accepts only what the general path accepts."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
    import many_chunks
    for layout in range(len(many_chunks.LAYOUTS)):
        for seed in range(4):
            data = bytes([200 + seed, 7, 0, seed, layout, seed, seed, 1])
            raw, n = many_chunks.build(data, max_chunks=3000)
            assert n > 100
            many_chunks.check(raw, n, timed=False)


# -- the tier's piece names and folders (issue 31, item 11) -------------------------------

@pytest.mark.parametrize("name", [".metadata\n", "__0_0.distcp\n"])
def test_piece_index_refuses_a_name_with_a_trailing_newline(name):
    from dcpx.storage import pieces as _pieces
    index = [[".metadata", 4], ["__0_0.distcp", 4]]
    _pieces.decode_index(json.dumps(index).encode(), "peer 1")          # the real names pass
    bad = [[name if n == name.rstrip("\n") else n, s] for n, s in index]
    with pytest.raises(CorruptCheckpointError, match="peer 1"):
        _pieces.decode_index(json.dumps(bad).encode(), "peer 1")
    for pattern, ok in ((_pieces.STEP_RE, "step-3"), (_pieces.KEY_RE, "j0123abcd-g1-bx-s2"),
                        (_pieces.PIECE_RE, "rank-0-of-2")):
        assert pattern.match(ok) and not pattern.match(ok + "\n")


def test_piece_received_over_a_symlinked_destination_leaves_no_link(tmp_path):
    """A piece folder that is a link to a folder elsewhere: the piece
    received replaces the link (the link goes, not what it points at) and
    no ``.deleting-`` entry is left behind; one a killed deletion left is
    removed as a link too."""
    from dcpx.storage import pieces as _pieces
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not the tier's")
    key_dir = tmp_path / "root" / "step-1" / "j0123abcd-g1-bx-s1"
    key_dir.mkdir(parents=True)
    dest = key_dir / "rank-0-of-1"
    dest.symlink_to(target, target_is_directory=True)
    import dcpx
    dcpx.save({}, checkpoint_id=tmp_path / "empty")  # a real piece's .metadata: no data files
    data = (tmp_path / "empty" / ".metadata").read_bytes()
    inc = _pieces.Incoming(dest, [[".metadata", len(data)]], "test", sync=False)
    try:
        inc.views()[0][0][:] = data  # the first file's (only) segment
        inc.commit()
    finally:
        inc.close()
    assert sorted(os.listdir(key_dir)) == ["rank-0-of-1"], os.listdir(key_dir)
    assert not dest.is_symlink() and (dest / ".metadata").read_bytes() == data
    assert (target / "keep.txt").read_text() == "not the tier's"
    # a .deleting- link left by a killed deletion: removed, its target kept
    (key_dir / ".deleting-rank-1-of-2-0123abcd").symlink_to(target, target_is_directory=True)
    _pieces.remove_debris(tmp_path / "root")
    assert sorted(os.listdir(key_dir)) == ["rank-0-of-1"]
    assert (target / "keep.txt").read_text() == "not the tier's"


# -- a Hugging Face index naming a key its shard lacks (issue 31, item 3) ----------------

def test_convert_refuses_an_index_key_no_shard_holds(tmp_path, capsys):
    """The index maps 'lost' to a shard that does not hold it: convert
    fails naming the key and the shard and writes no output (it wrote an
    output without the key, exit 0)."""
    st = pytest.importorskip("safetensors.torch")
    d = _hf_folder(tmp_path, {"w": "model-00001-of-00002.safetensors",
                              "lost": "model-00002-of-00002.safetensors"})
    (d / "model-00001-of-00001.safetensors").rename(d / "model-00001-of-00002.safetensors")
    st.save_file({"other": torch.ones(2)}, str(d / "model-00002-of-00002.safetensors"))
    for out in (tmp_path / "out", tmp_path / "out.safetensors", tmp_path / "out.pt"):
        assert _cli("convert", d, out) == 1
        err = capsys.readouterr().err
        assert "'lost'" in err and "model-00002-of-00002.safetensors" in err, err
        assert not out.exists()
    assert _cli("diff", d, d) == 1
    assert "'lost'" in capsys.readouterr().err


# -- a torch.save input whose state dict nests shared containers (issue 31, item 6) -------

def test_convert_and_diff_refuse_a_state_dict_of_shared_nesting(tmp_path):
    """A 2 KB torch.save file whose state dict is a dict (or list of
    tensors and lists) of two references to one ... 40 levels deep: it
    flattens into 2**40 keys; convert and diff hung in flattening it.  In a
    subprocess, so that a hang fails the test (the limit is no timing)."""
    import subprocess
    import sys
    names = []
    for kind in ("dict", "list"):
        x: object = {"t": torch.ones(1)} if kind == "dict" else [torch.ones(1)]
        for _ in range(40):
            x = {"a": x, "b": x} if kind == "dict" else [x, x]
        torch.save({"w": torch.ones(2), "v": x}, tmp_path / f"{kind}.pt")
        assert (tmp_path / f"{kind}.pt").stat().st_size < 8192
        names.append(f"{kind}.pt")
    script = (
        "import contextlib, io, json, sys\n"
        "from dcpx.cli import main\n"
        "root, out = sys.argv[1], []\n"
        "for name in sys.argv[2:]:\n"
        "    f = root + '/' + name\n"
        "    for argv in (['convert', f, f + '.out'], ['diff', f, f]):\n"
        "        err = io.StringIO()\n"
        "        with contextlib.redirect_stderr(err):\n"
        "            rc = main(argv)\n"
        "        out.append((argv, rc, err.getvalue()))\n"
        "json.dump(out, open(root + '/out.json', 'w'))\n")
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), *names],
                       env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for argv, rc, err in json.loads((tmp_path / "out.json").read_text()):
        assert rc == 1 and Path(argv[1]).name in err and "shared" in err, (argv, err)
        assert not Path(argv[1] + ".out").exists()


def test_shared_containers_of_a_sane_size_still_convert(tmp_path):
    tied = [torch.arange(3.0)]
    torch.save({"a": tied, "b": tied}, tmp_path / "tied.pt")
    assert _cli("convert", tmp_path / "tied.pt", tmp_path / "tied") == 0
    got = {"a": [torch.empty(3)], "b": [torch.empty(3)]}
    dcpx.load(got, checkpoint_id=tmp_path / "tied")
    assert torch.equal(got["b"][0], tied[0])
