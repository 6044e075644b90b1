"""The CUDA load pipeline (csrc/cuda_pipeline.c, ``_C.cuda_load_pipeline``, and
``FileSystemReader._read_to_devices`` over it) and batched copies
(``cuMemcpyBatchAsync``, csrc/cuda.c and csrc/cuda_copy.c) against the stand-in
driver (tests/fake_cuda/fake_libcuda.c): no GPU needed.

What is checked: loads through runs of small archives and pieces of long ones
are bit exact over two devices, with and without batched copies, ordered after
the consumer streams' pending kernels; reading overlaps copying (with every
copy held, the reader threads fill every slot) and a slot is never refilled
before its copies ran (the load blocks with every slot in flight; the
stand-in's reuse check, which compares a copy's source when it runs with what
it was when queued, sees no change, and fires for a caller that reuses a
buffer too early); each failure (a failing copy, batched call, event record or
wait, an asynchronous copy failure, a short read, a CRC mismatch in a run and
in a piece) raises a precise exception naming the key (and the file, for read
failures), leaves no copy running, no registration behind, and no thread
hanging, and the next load works; resharding reads (a byte range of the
chunk) go through the pipeline and casts, column slices and compressed records
through torch's copy, as the stats say; destinations that overlap are read
last in torch's order; many small tensors take few batched calls, adjacent raw
extents into one allocation one merged copy without them; staging batches its
device-to-host copies; the CUDA 13 ABI (cuMemcpyBatchAsync_v2) and a driver
without batched copies, in a subprocess each.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dcpx import _C

from cuda_standin import ILLEGAL_ADDRESS, INVALID_VALUE, OUT_OF_MEMORY, FakeCudaTensor, call_log
from test_cuda_standin import _CudaTarget, _raw

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pipe(lib, monkeypatch):
    """dcpx.storage.reader with a load ring of 4 slots of 16 KiB and the stand-in's
    device streams as torch's current streams."""
    from types import SimpleNamespace

    from dcpx.storage import reader as _reader
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev: SimpleNamespace(cuda_stream=lib.devices[dev.index].stream))
    monkeypatch.setattr(_reader, "_PINNED_LOAD", 4 * 16384)
    monkeypatch.setattr(_reader, "_SLOT", 16384)
    monkeypatch.setattr(_reader, "_pinned_buffer", None)
    registered = _C.cuda_registered()
    yield _reader
    if _reader._pinned_buffer is not None:
        assert _C.cuda_registered()[0] == registered[0] + 1  # the ring, once
        _C.cuda_host_unregister(_reader._pinned_buffer)
    assert _C.cuda_registered() == registered


def _save(tmp_path, sd, name="ckpt"):
    import dcpx
    dcpx.save(sd, checkpoint_id=str(tmp_path / name))
    return tmp_path / name


def _mixed(seed=1):
    """Small tensors (runs), tensors longer than a 16 KiB slot (pieces),
    an empty one, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(40, 30, generator=g),
            "big": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=g),
            "w": torch.randn(1000, generator=g, dtype=torch.float64),
            "h": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "huge": torch.randn(9000, generator=g),  # 36 KB: 3 pieces
            "empty": torch.empty(0, 5),
            "b": torch.tensor([True, False, True]),
            **{f"s{i}": torch.randn(5 + i, generator=g) for i in range(12)}}


class _Target(_CudaTarget):
    """A stand-in destination that also takes torch's copy_ (the path of
    reads the pipeline refuses): the bytes of the CPU source, cast."""

    def copy_(self, src):
        self.t.write(_raw(src.to(self.dtype)))
        return self

    def numel(self):
        return self.shape.numel()


def _targets(lib, sd, devs=(0, 1), fill=b"\xab"):
    out = {}
    for i, (k, v) in enumerate(sd.items()):
        ft = FakeCudaTensor(lib.devices[devs[i % len(devs)]], v.numel() * v.element_size())
        ft.write(fill * ft.nbytes)
        out[k] = ft
    return out


def _reader_reads(path, sd, targets, narrow=None):
    """A set-up reader and one read per key into its stand-in target
    (narrow: {key: (offsets, lengths, target_shape)})."""
    import dcpx
    from dcpx.storage import reader as _reader
    reader = dcpx.FileSystemReader(str(path))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    infos = {k.fqn: v for k, v in md.storage_data.items()}
    reads = []
    for key, v in sd.items():
        shape, nar = v.shape, None
        if narrow and key in narrow:
            offs, lens, shape = narrow[key]
            nar = (offs, lens)
        reads.append(_reader._TensorRead(key, infos[key], v.shape, v.dtype,
                                         _Target(targets[key], v.dtype, shape), nar))
    return reader, reads


def _free(targets):
    for ft in targets.values():
        ft.free()


def _in_thread(fn):
    """Run fn in a thread; (thread, box) where box gets its result or error."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.002)


# --------------------------------------------------------------------------
# loads through the pipeline

@pytest.mark.parametrize("batch", [False, True], ids=["per-copy", "batched"])
def test_the_pipeline_is_bit_exact_through_runs_and_pieces(pipe, lib, tmp_path, batch):
    """Runs of small archives and pieces of long ones, two devices, pending
    writing kernels on the consumer streams: bit exact, ordered after the
    kernels, no slot source changed under a copy; the stats say what ran."""
    sd = _mixed()
    path = _save(tmp_path, sd)
    if batch:
        _C.cuda_batch_copies(True)
    try:
        lib.fake_set_delay(b"fill", 5_000)
        lib.fake_set_delay(b"copy_jitter", 1_000)
        for rnd in range(2):
            targets = _targets(lib, sd)
            for ft in targets.values():
                if ft.nbytes:
                    ft.launch_fill(0x30 + rnd)
            reader, reads = _reader_reads(path, sd, targets)
            reader.read_tensors(reads)
            for key, v in sd.items():
                assert targets[key].read() == _raw(v), key
            _free(targets)
            st = reader.cuda_load_stats
            assert st["pipeline"] == len(sd) and "torch_copy" not in st
            ps = st["pipeline_stats"]
            assert ps["pieces"] == 5 + 3 and ps["runs"] >= 2 and ps["devices"] == 2
            assert ps["batch_api"] == ("cuMemcpyBatchAsync" if batch else None)
            if batch:
                assert ps["batch_calls"] >= 1 and ps["batched_copies"] >= 2
            else:
                assert ps["batch_calls"] == 0
        assert lib.fake_violations() == 0
        assert lib.fake_reuse_violations() == 0
        assert lib.fake_copies_run() == lib.fake_copies_queued()
    finally:
        _C.cuda_batch_copies(False)


@pytest.mark.parametrize("seed", range(3))
def test_slots_are_never_refilled_under_their_copies(pipe, lib, tmp_path, seed):
    """Random sizes (small, about a slot, several slots) and random copy
    delays, three reader threads on four slots: each refill must wait for
    the slot's copies, or the stand-in's reuse check counts a source that
    changed under its queued copy (and the bytes on the device are the
    next unit's).  Bit exact, no reuse violation, slots reused."""
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 3000), rng.randint(3000, 16000),
                         rng.randint(16000, 50000)]) for _ in range(30)]
    g = torch.Generator().manual_seed(seed)
    sd = {f"t{i:02d}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
          for i, n in enumerate(sizes)}
    path = _save(tmp_path, sd)
    lib.fake_set_delay(b"copy_jitter", 2_000)
    targets = _targets(lib, sd)
    reader, reads = _reader_reads(path, sd, targets)
    reader._pipeline_threads = 3
    reader.read_tensors(reads)
    for key, v in sd.items():
        assert targets[key].read() == _raw(v), key
    _free(targets)
    ps = reader.cuda_load_stats["pipeline_stats"]
    assert ps["threads"] == 3 and ps["slots"] == 4 and ps["slot_reuses"] > 0
    assert lib.fake_reuse_violations() == 0 and lib.fake_violations() == 0


def test_the_reuse_check_fires_for_a_buffer_reused_too_early(lib):
    """The negative control of the check above: a host buffer changed while
    a copy out of it is still queued is counted."""
    t = FakeCudaTensor(lib.devices[0], 4096)
    src = torch.zeros(4096, dtype=torch.uint8)
    lib.fake_hold_copies(1)
    p = _C.cuda_copy_from_host([(t, src, "x")], wait=False)
    src.fill_(7)  # reused before the copy ran
    lib.fake_hold_copies(0)
    _C.cuda_wait(p)
    assert lib.fake_reuse_violations() == 1
    t.free()


def test_reading_overlaps_copying_and_a_full_ring_waits(pipe, lib, tmp_path):
    """With every copy held by the stand-in, the readers fill all four
    slots (the copies of several units queued, none run: reading went on
    while copies were pending) and then the load waits: no slot is read
    into while its copies are pending.  Released, it completes bit exact."""
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i}": torch.randint(0, 255, (12_000,), dtype=torch.uint8, generator=g)
          for i in range(10)}  # one archive a slot
    path = _save(tmp_path, sd)
    targets = _targets(lib, sd, devs=(0,))
    reader, reads = _reader_reads(path, sd, targets)
    reader._pipeline_threads = 3
    lib.fake_hold_copies(1)
    t, box = _in_thread(lambda: reader.read_tensors(reads))
    try:
        _wait_for(lambda: lib.fake_copies_queued() == 4, "four slots in flight")
        time.sleep(0.2)  # a reader that did not wait would queue a fifth
        assert lib.fake_copies_queued() == 4 and lib.fake_copies_run() == 0
        assert t.is_alive()
    finally:
        lib.fake_hold_copies(0)
    t.join(60)
    assert not t.is_alive() and "error" not in box, box
    for key, v in sd.items():
        assert targets[key].read() == _raw(v), key
    _free(targets)
    log = call_log(lib)
    assert sum(e["kind"] == "htod" for e in log) == 10
    # every refill of a slot came after a wait on an event: the n-th copy
    # (n >= 4, one a slot) after at least n - 3 waits
    copies = syncs = 0
    for e in log:
        if e["kind"] == "evsync":
            syncs += 1
        elif e["kind"] == "htod":
            assert copies < 4 or syncs >= copies - 3, (copies, syncs)
            copies += 1
    base = pipe._pinned_buffer.data_ptr()
    assert {(e["host"] - base) // 16384 for e in log if e["kind"] == "htod"} == {0, 1, 2, 3}
    assert lib.fake_reuse_violations() == 0


# --------------------------------------------------------------------------
# failures: precise, nothing left running, no hang, the next load works

def _load_fails(reader, reads, exc, match):
    t, box = _in_thread(lambda: reader.read_tensors(reads))
    t.join(60)
    assert not t.is_alive(), "the load hung"
    assert isinstance(box.get("error"), exc), box
    assert match in str(box["error"]), str(box["error"])
    return box["error"]


CUDA_FAILURES = [
    # (entry point, nth call, code, batched, what the message names)
    ("cuMemcpyHtoDAsync_v2", 2, OUT_OF_MEMORY, False,
     "cuMemcpyHtoDAsync for tensor 'big' on device 0"),
    ("cuMemcpyHtoDAsync_v2", 9, INVALID_VALUE, False,
     "cuMemcpyHtoDAsync for tensor 'huge' on device 0"),
    ("cuEventRecord", 3, INVALID_VALUE, False, "cuEventRecord for tensor 'big' on device 0"),
    ("cuEventSynchronize", 1, ILLEGAL_ADDRESS, False,
     "cuEventSynchronize (host-to-device copies) on device 0 (tensors 'emb'"),
    ("cuStreamWaitEvent", 2, INVALID_VALUE, False,
     "cuStreamWaitEvent on the consumer's stream on device 0"),
    ("cuMemcpyBatchAsync", 1, OUT_OF_MEMORY, True,
     "cuMemcpyBatchAsync (a batch starting with the copy) for tensor 'w' on device 0"),
]


@pytest.mark.parametrize("call,nth,code,batch,names", CUDA_FAILURES,
                         ids=[f"{f[0]}-{f[1]}" for f in CUDA_FAILURES])
def test_each_cuda_failure_is_named_and_leaves_nothing_running(pipe, lib, tmp_path, call, nth,
                                                                 code, batch, names):
    """One reader thread: a deterministic order of calls (copies of 'emb',
    'big''s five pieces, 'w' and 'h' (one run), 'huge''s three pieces, 'b'
    and the small ones (runs)), each failure named."""
    sd = _mixed()
    path = _save(tmp_path, sd)
    targets = _targets(lib, sd, devs=(0,))
    reader, reads = _reader_reads(path, sd, targets)
    reader._pipeline_threads = 1
    if batch:
        _C.cuda_batch_copies(True)
    try:
        lib.fake_set_delay(b"copy", 500)
        lib.fake_fail(call.encode(), nth, code)
        err = _load_fails(reader, reads, _C.CudaError, names)
        assert err.code == code
        assert lib.fake_copies_run() == lib.fake_copies_queued()
        lib.fake_reset()
        reader, reads = _reader_reads(path, sd, targets)
        reader.read_tensors(reads)
        for key, v in sd.items():
            assert targets[key].read() == _raw(v), key
    finally:
        _C.cuda_batch_copies(False)
        _free(targets)


def test_an_asynchronous_copy_failure_is_named_at_the_wait(pipe, lib, tmp_path):
    sd = _mixed()
    path = _save(tmp_path, sd)
    targets = _targets(lib, sd, devs=(1,))
    reader, reads = _reader_reads(path, sd, targets)
    lib.fake_fail_async(3, ILLEGAL_ADDRESS)
    err = _load_fails(reader, reads, _C.CudaError, "on device 1")
    assert err.code == ILLEGAL_ADDRESS and "cuEventSynchronize" in str(err)
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(err) and "(tensors '" in str(err)
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    _free(targets)


@pytest.mark.parametrize("which", ["w", "huge"], ids=["in-a-run", "in-pieces"])
def test_a_crc_mismatch_names_the_key_and_the_file(pipe, lib, tmp_path, which):
    """A flipped byte inside a small archive's tensor bytes (checked in its
    slot before any copy: nothing of it reaches the device) or a long one's
    (the pieces' CRCs combined once all are read)."""
    from dcpx.errors import CorruptCheckpointError
    sd = _mixed()
    path = _save(tmp_path, sd)
    targets = _targets(lib, sd)
    reader, reads = _reader_reads(path, sd, targets)
    r = next(r for r in reads if r.key == which)
    f = path / r.info.relative_path
    raw = bytearray(f.read_bytes())
    at = raw.find(_raw(sd[which]), r.info.offset)
    assert r.info.offset < at < r.info.offset + r.info.length
    raw[at + len(_raw(sd[which])) // 2] ^= 0x40
    f.write_bytes(bytes(raw))
    err = _load_fails(reader, reads, CorruptCheckpointError, f"key {which!r}")
    assert str(f) in str(err) and "CRC-32 mismatch" in str(err)
    if which == "w":
        assert targets["w"].read() == b"\xab" * targets["w"].nbytes
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    _free(targets)


@pytest.mark.parametrize("cut", ["run", "piece"])
def test_a_short_read_names_the_key_and_the_file(pipe, lib, tmp_path, cut):
    """The data file cut inside the last archive (a run's pread comes back
    short, then each archive alone reports its own) or inside a long
    archive's tensor bytes (a piece's pread): an error naming that key and
    the file; the others still load."""
    from dcpx.errors import CorruptCheckpointError
    g = torch.Generator().manual_seed(9)
    if cut == "run":
        sd = {f"s{i}": torch.randn(50, generator=g) for i in range(6)}
        key = "s5"
    else:
        sd = {"a": torch.randn(20, generator=g), "long": torch.randn(20_000, generator=g)}
        key = "long"
    path = _save(tmp_path, sd)
    targets = _targets(lib, sd, devs=(0,))
    reader, reads = _reader_reads(path, sd, targets)
    r = next(r for r in reads if r.key == key)
    f = path / r.info.relative_path
    os.truncate(f, r.info.offset + r.info.length - (r.info.length // 3))
    err = _load_fails(reader, reads, CorruptCheckpointError, f"key {key!r}")
    assert str(f) in str(err) and "shorter than the metadata says" in str(err)
    other = "s0" if cut == "run" else "a"
    assert targets[other].read() == _raw(sd[other])
    assert lib.fake_copies_run() == lib.fake_copies_queued()
    _free(targets)


# --------------------------------------------------------------------------
# which path each read takes

def test_resharding_reads_of_one_byte_range_go_through_the_pipeline(pipe, lib, tmp_path):
    """Parts of saved chunks narrowed along the leading dimension (and a
    row of a 3-d chunk) are one byte range: the pipeline reads the chunk
    (CRC over all of it) and copies that range; a column slice is not one
    range and goes through torch's copy, as the stats say."""
    g = torch.Generator().manual_seed(5)
    sd = {"rows": torch.randn(64, 32, generator=g),          # 8 KiB: a run
          "long": torch.randn(200, 100, generator=g),        # 80 KB: pieces
          "cube": torch.randn(4, 5, 6, generator=g),
          "cols": torch.randn(10, 8, generator=g)}
    path = _save(tmp_path, sd)
    narrow = {"rows": ((16, 0), (20, 32), (20, 32)),
              "long": ((150, 0), (37, 100), (37, 100)),
              "cube": ((2, 3, 0), (1, 2, 6), (1, 2, 6)),
              "cols": ((0, 2), (10, 3), (10, 3))}
    want = {"rows": sd["rows"][16:36], "long": sd["long"][150:187],
            "cube": sd["cube"][2:3, 3:5], "cols": sd["cols"][:, 2:5]}
    targets = {}
    for k, v in want.items():
        targets[k] = FakeCudaTensor(lib.devices[0], v.numel() * v.element_size())
    reader, reads = _reader_reads(path, sd, targets, narrow)
    reader.read_tensors(reads)
    for k, v in want.items():
        assert targets[k].read() == _raw(v), k
    st = reader.cuda_load_stats
    assert st["pipeline"] == 3 and st["torch_copy"] == 1
    assert st["torch_copy_reasons"] == {"part of the chunk not one byte range": 1}
    assert st["pipeline_bytes"] == sum(want[k].numel() * 4 for k in ("rows", "long", "cube"))
    _free(targets)


def test_pipeline_refusals_name_their_reason():
    """The rule, on host tensors (the device is checked by the caller)."""
    from dcpx.storage import reader as _reader
    from dcpx.storage.reader import _TensorRead, _byte_window, _pipeline_refusal
    x = torch.zeros(4, 6)

    def read(target, dtype=torch.float32, chunk=(4, 6), narrow=None, info=None):
        return _TensorRead("k", info or object(), torch.Size(chunk), dtype, target, narrow)

    assert _pipeline_refusal(read(x)) is None
    assert _pipeline_refusal(read(x.t(), chunk=(6, 4))) == "non-contiguous destination"
    assert _pipeline_refusal(read(x.double())) == "dtype cast"
    assert _pipeline_refusal(read(torch.zeros(2, 6), narrow=((1, 0), (2, 6)))) is None
    assert _pipeline_refusal(read(torch.zeros(4, 2), narrow=((0, 1), (4, 2)))) == \
        "part of the chunk not one byte range"
    from types import SimpleNamespace
    assert _pipeline_refusal(read(x, info=SimpleNamespace(transform_descriptors=["zstd"]))) \
        == "compressed record"
    assert _byte_window((4, 6), (1, 0), (2, 6), 4) == (24, 48)
    assert _byte_window((4, 5, 6), (2, 3, 0), (1, 2, 6), 2) == ((2 * 30 + 18) * 2, 24)
    assert _byte_window((4, 5, 6), (2, 3, 1), (1, 1, 4), 1) == (2 * 30 + 18 + 1, 4)
    assert _byte_window((4, 5, 6), (0, 0, 1), (2, 5, 4), 1) is None
    assert _byte_window((), (), (), 8) == (0, 8)
    assert _reader._slot_bytes() >= 4096


def test_casts_and_torch_only_records_go_through_torch_and_say_so(pipe, lib, tmp_path,
                                                                   monkeypatch):
    """A cast is refused before reading (torch's copy_ casts); a record the C
    reader leaves to torch.load (a torch.save of a view of a larger storage)
    comes back from the pipeline as such, is loaded by torch.load and
    copied; the stats count both."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    import dcpx
    from dcpx.storage import reader as _reader
    monkeypatch.setattr(_reader, "_cast_error", lambda *a: None)  # torch here has no CUDA
    g = torch.Generator().manual_seed(6)
    sd = {"f": torch.randn(100, generator=g), "x": torch.randn(30, generator=g)}
    path = _save(tmp_path, sd)
    base = torch.randn(8, 8, generator=g)
    buf = io.BytesIO()
    torch.save(base[2:4], buf)  # the whole 8x8 storage, at an offset
    (path / "view.bin").write_bytes(buf.getvalue())
    reader = dcpx.FileSystemReader(str(path))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    infos = {k.fqn: v for k, v in md.storage_data.items()}
    view_info = _StorageInfo("view.bin", 0, len(buf.getvalue()))
    targets = {"f": FakeCudaTensor(lib.devices[0], 100 * 8),  # float32 loaded as float64
               "x": FakeCudaTensor(lib.devices[0], 30 * 4),
               "view": FakeCudaTensor(lib.devices[1], 2 * 8 * 4)}
    reads = [_reader._TensorRead("f", infos["f"], sd["f"].shape, torch.float32,
                                 _Target(targets["f"], torch.float64, (100,)), None),
             _reader._TensorRead("x", infos["x"], sd["x"].shape, torch.float32,
                                 _Target(targets["x"], torch.float32, (30,)), None),
             _reader._TensorRead("view", view_info, torch.Size((2, 8)), torch.float32,
                                 _Target(targets["view"], torch.float32, (2, 8)), None)]
    reader.read_tensors(reads)
    assert targets["f"].read() == _raw(sd["f"].double())
    assert targets["x"].read() == _raw(sd["x"])
    assert targets["view"].read() == _raw(base[2:4])
    st = reader.cuda_load_stats
    assert st["pipeline"] == 2 and st["torch_copy"] == 2
    assert st["torch_copy_reasons"] == {"dtype cast": 1, "torch-only record": 1}
    _free(targets)


def test_archives_in_the_other_byte_order_are_swapped_in_the_slot(pipe, lib, tmp_path,
                                                                  monkeypatch):
    """A checkpoint written on a big-endian host: each archive's bytes are
    swapped in its slot after the CRC (runs and pieces), before the copy."""
    from test_byteorder import save_big_dcp
    g = torch.Generator().manual_seed(12)
    sd = {"f": torch.randn(3, 5, generator=g), "d": torch.randn(5000, generator=g).double(),
          "i": torch.randint(-9, 9, (7,), dtype=torch.int16, generator=g)}
    save_big_dcp(monkeypatch, sd, tmp_path / "ck")
    targets = _targets(lib, sd)
    reader, reads = _reader_reads(tmp_path / "ck", sd, targets)
    reader.read_tensors(reads)
    for key, v in sd.items():
        assert targets[key].read() == _raw(v), key
    assert reader.cuda_load_stats["pipeline_stats"]["pieces"] == 3
    _free(targets)


@pytest.mark.parametrize("batch", [False, True], ids=["per-copy", "batched"])
def test_overlapping_destinations_are_read_last_in_torchs_order(pipe, lib, tmp_path, batch):
    """Two keys bound to one device tensor (tied weights) and a third whose
    destination overlaps half of it: read after the others, one at a time,
    in the items' order (a batch has no order; the stand-in runs a batch
    backwards), so the last one wins as with torch."""
    g = torch.Generator().manual_seed(7)
    sd = {"a": torch.randn(512, generator=g), "tied": torch.randn(512, generator=g),
          "half": torch.randn(256, generator=g), "free": torch.randn(64, generator=g),
          **{f"x{i}": torch.randn(8, generator=g) for i in range(4)}}
    path = _save(tmp_path, sd)
    shared = FakeCudaTensor(lib.devices[0], 2048)
    targets = {"a": shared, "tied": shared,
               "half": FakeCudaTensor(lib.devices[0], 1024, base=shared, offset=1024)}
    for k in ("free", "x0", "x1", "x2", "x3"):
        targets[k] = FakeCudaTensor(lib.devices[0], sd[k].numel() * 4)
    if batch:
        _C.cuda_batch_copies(True)
    try:
        reader, reads = _reader_reads(path, sd, targets)
        reader.read_tensors(reads)
    finally:
        _C.cuda_batch_copies(False)
    want = bytearray(_raw(sd["tied"]))
    want[1024:] = _raw(sd["half"])
    assert shared.read() == bytes(want)
    for k in ("free", "x0", "x3"):
        assert targets[k].read() == _raw(sd[k])
    assert reader.cuda_load_stats["pipeline_stats"]["serial"] == 3
    shared.free()
    for k in ("free", "x0", "x1", "x2", "x3"):
        targets[k].free()


# --------------------------------------------------------------------------
# many small tensors in few driver calls

def test_many_small_tensors_load_in_few_batched_calls(pipe, lib, tmp_path, monkeypatch):
    """600 small tensors: with cuMemcpyBatchAsync a run's copies are one
    call (the ring of 64 KiB slots: a few runs), none one by one; without
    it, one cuMemcpyHtoDAsync each.  Both bit exact."""
    from dcpx.storage import reader as _reader
    monkeypatch.setattr(_reader, "_PINNED_LOAD", 4 << 20)
    monkeypatch.setattr(_reader, "_SLOT", 1 << 20)
    g = torch.Generator().manual_seed(8)
    sd = {f"p{i}": torch.randn(16 + i % 7, generator=g) for i in range(600)}
    path = _save(tmp_path, sd)
    for batch in (True, False):
        _C.cuda_batch_copies(batch)
        lib.fake_reset()
        before = _C.cuda_copy_stats()
        try:
            targets = _targets(lib, sd, devs=(0,))
            reader, reads = _reader_reads(path, sd, targets)
            reader.read_tensors(reads)
        finally:
            _C.cuda_batch_copies(False)
        for key, v in sd.items():
            assert targets[key].read() == _raw(v), key
        _free(targets)
        after = _C.cuda_copy_stats()
        ps = reader.cuda_load_stats["pipeline_stats"]
        if batch:
            calls = lib.fake_calls(b"cuMemcpyBatchAsync")
            assert 1 <= calls <= 4 and calls == ps["batch_calls"] == ps["runs"]
            assert lib.fake_calls(b"cuMemcpyHtoDAsync_v2") == 0
            assert after["batched_htod"] - before["batched_htod"] == 600
            assert after["batch_htod_calls"] - before["batch_htod_calls"] == calls
        else:
            assert lib.fake_calls(b"cuMemcpyHtoDAsync_v2") == 600 == ps["htod_calls"]
            assert lib.fake_calls(b"cuMemcpyBatchAsync") == 0
    assert lib.fake_reuse_violations() == 0


def test_adjacent_raw_extents_into_one_allocation_are_one_copy(lib, tmp_path):
    """Without batched copies: raw extents next to each other in a file
    (safetensors' layout) read into views adjacent in one allocation (the
    same alloc_key) merge into one cuMemcpyHtoDAsync; with different keys,
    one each."""
    data = random.Random(1).randbytes(10 * 256)
    f = tmp_path / "raw.bin"
    f.write_bytes(data)
    whole = FakeCudaTensor(lib.devices[0], len(data))
    ring = torch.empty(4 * 16384, dtype=torch.uint8)
    assert _C.cuda_host_register(ring)
    try:
        for key_of, calls in ((lambda i: 77, 1), (lambda i: 100 + i, 10)):
            lib.fake_reset()
            whole.write(b"\0" * len(data))
            views = [FakeCudaTensor(lib.devices[0], 256, base=whole, offset=256 * i)
                     for i in range(10)]
            items = [(0, 256 * i, 256, "", (256,), 1, v.capsule(), 0, f"r{i}", key_of(i))
                     for i, v in enumerate(views)]
            failures, stats = _C.cuda_load_pipeline([str(f)], items, ring, slot_bytes=16384)
            assert failures == [] and whole.read() == data
            assert lib.fake_calls(b"cuMemcpyHtoDAsync_v2") == calls == stats["htod_calls"]
            assert stats["merged"] == 10 - calls
    finally:
        _C.cuda_host_unregister(ring)
        whole.free()


def test_pipeline_items_are_checked_before_anything_is_read(lib, tmp_path):
    f = tmp_path / "raw.bin"
    f.write_bytes(bytes(512))
    t = FakeCudaTensor(lib.devices[0], 256)
    ring = torch.empty(8192, dtype=torch.uint8)
    cases = [
        ((0, 0, 256, "", (256,), 1, t, 300, "w"), ValueError, "'w' takes bytes past the end"),
        ((0, 0, 256, "", (256,), 1, torch.zeros(256, dtype=torch.uint8), 0, "h"), ValueError,
         "'h' is not on a CUDA device"),
        ((3, 0, 256, "", (256,), 1, t, 0, "i"), IndexError, "file index"),
        ((0, 0, 256, "", (-1,), 1, t, 0, "s"), ValueError, "'s' has a bad shape"),
    ]
    for item, exc, match in cases:
        with pytest.raises(exc, match=match):
            _C.cuda_load_pipeline([str(f)], [item], ring, slot_bytes=4096)
    with pytest.raises(ValueError, match="at least two slots"):
        _C.cuda_load_pipeline([str(f)], [], torch.empty(4096, dtype=torch.uint8),
                              slot_bytes=4096)
    assert lib.fake_copies_queued() == 0
    t.free()


# --------------------------------------------------------------------------
# staging: device-to-host copies batched

def test_staging_batches_its_copies_from_separate_allocations(batched, tmp_path):
    """cuda_copy_into: 40 tensors in 40 allocations into a pinned buffer:
    one batched call per device (waiting and in segments), bit exact; into
    a pageable buffer, one copy each; a failing batch names its first key."""
    lib = batched
    ts = [FakeCudaTensor(lib.devices[i % 2], 100 + 8 * i) for i in range(40)]
    data = [random.Random(i).randbytes(t.nbytes) for i, t in enumerate(ts)]
    for t, d in zip(ts, data):
        t.write(d)
    offs, total = [], 0
    for t in ts:
        offs.append(total)
        total += -(-t.nbytes // 64) * 64
    buf = torch.zeros(total, dtype=torch.uint8)
    assert _C.cuda_host_register(buf)
    try:
        pairs = [(t, o, f"w{i}", t.alloc) for i, (t, o) in enumerate(zip(ts, offs))]
        _C.cuda_copy_into(pairs, buf)
        raw = buf.numpy().tobytes()
        assert all(raw[o:o + len(d)] == d for o, d in zip(offs, data))
        assert lib.fake_calls(b"cuMemcpyBatchAsync") == 2
        assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 0
        lib.fake_reset()
        buf.zero_()
        gate, pending = _C.cuda_copy_into(pairs, buf, wait=False, segment_bytes=2048)
        _C.cuda_stage_wait(pending)
        raw = buf.numpy().tobytes()
        assert all(raw[o:o + len(d)] == d for o, d in zip(offs, data))
        assert lib.fake_calls(b"cuMemcpyBatchAsync") >= 3
        lib.fake_reset()
        lib.fake_fail(b"cuMemcpyBatchAsync", 1, OUT_OF_MEMORY)
        with pytest.raises(_C.CudaError, match="cuMemcpyBatchAsync \\(a batch starting with "
                                               "the copy\\) for tensor 'w0' on device 0"):
            _C.cuda_copy_into(pairs, buf)
        assert lib.fake_copies_run() == lib.fake_copies_queued()
    finally:
        _C.cuda_host_unregister(buf)
    lib.fake_reset()
    pageable = torch.zeros(total, dtype=torch.uint8)
    _C.cuda_copy_into(pairs, pageable)
    assert lib.fake_calls(b"cuMemcpyBatchAsync") == 0
    assert lib.fake_calls(b"cuMemcpyDtoHAsync_v2") == 40
    for t in ts:
        t.free()


def test_a_bad_copy_in_a_batch_is_named_by_the_drivers_index(batched):
    """The 12.8 ABI's failIdx names the failing copy: a source that is not
    device memory (the stand-in refuses it in the batch)."""
    lib = batched
    ts = [FakeCudaTensor(lib.devices[0], 256) for _ in range(4)]
    buf = torch.zeros(1024, dtype=torch.uint8)
    assert _C.cuda_host_register(buf)
    try:
        pairs = [(t.capsule(), 256 * i, f"k{i}") for i, t in enumerate(ts)]
        # k2's allocation freed: its pointer is no device memory any more
        ts[2].free()
        with pytest.raises(_C.CudaError, match="cuMemcpyBatchAsync for tensor 'k2' on device 0"):
            _C.cuda_copy_into(pairs, buf)
        assert lib.fake_copies_queued() == 0
    finally:
        _C.cuda_host_unregister(buf)
    for t in ts:
        t.free()


# --------------------------------------------------------------------------
# the CUDA 13 ABI and a driver without batched copies (fresh processes)

_ABI_SCRIPT = textwrap.dedent("""
    import os, random, sys, tempfile
    sys.path.insert(0, {tests!r})
    import numpy as np  # host buffers without importing torch (seconds saved)
    from cuda_standin import FakeCudaTensor, Device, load
    from dcpx import _C
    lib = load({lib!r})
    assert lib.cuInit(0) == 0
    print("api", _C.cuda_batch_copies())
    dev = Device(lib, 0)
    ts = [FakeCudaTensor(dev, 64 + i) for i in range(30)]
    data = [random.Random(i).randbytes(t.nbytes) for i, t in enumerate(ts)]
    for t, d in zip(ts, data):
        t.write(d)
    buf = np.zeros(30 * 128, dtype=np.uint8)
    assert _C.cuda_host_register(buf)
    _C.cuda_copy_into([(t, 128 * i, "k%d" % i) for i, t in enumerate(ts)], buf)
    raw = buf.tobytes()
    assert all(raw[128 * i:128 * i + len(d)] == d for i, d in enumerate(data))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "raw")
        with open(f, "wb") as fh:
            fh.write(raw)
        outs = [FakeCudaTensor(dev, 64 + i) for i in range(30)]
        ring = np.empty(8 * 16384, dtype=np.uint8)
        assert _C.cuda_host_register(ring)
        failures, st = _C.cuda_load_pipeline(
            [f], [(0, 128 * i, 64 + i, "", (64 + i,), 1, o.capsule(), 0, "o%d" % i)
                  for i, o in enumerate(outs)], ring, slot_bytes=16384)
        assert failures == [] and [o.read() for o in outs] == data
    print("calls", lib.fake_calls(b"cuMemcpyBatchAsync_v2"), lib.fake_calls(b"cuMemcpyBatchAsync"),
          lib.fake_calls(b"cuMemcpyDtoHAsync_v2"), lib.fake_calls(b"cuMemcpyHtoDAsync_v2"))
    print("stats", st["batch_api"], st["batch_calls"])
""")


@pytest.mark.parametrize("version,api,calls", [
    ("13000", "cuMemcpyBatchAsync_v2", "calls 2 0 0 0"),
    ("12060", "None", "calls 0 0 30 30")], ids=["cuda13", "cuda12.6"])
def test_the_batch_abi_follows_the_driver(standin_path, version, api, calls):
    env = dict(os.environ, DCPX_LIBCUDA=str(standin_path), FAKE_CUDA_DEVICES="1",
               FAKE_CUDA_DRIVER_VERSION=version)
    r = subprocess.run([sys.executable, "-c", _ABI_SCRIPT.format(
        tests=str(REPO / "tests"), lib=str(standin_path))], env=env, capture_output=True,
        text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"api {api}"
    assert lines[1] == calls
    assert lines[2] == ("stats cuMemcpyBatchAsync_v2 1" if api != "None" else "stats None 0")


# --------------------------------------------------------------------------
# the upload's priority knob (DCPX_WRITER_NICE; bench_gpu.py's "nice 10")

def _thread_nices() -> dict:
    """{tid: nice} of this process's threads (/proc/self/task/*/stat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = int(fields[16])  # field 19 of stat: nice
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_writer_threads_lower_their_priority_when_asked(lib, tmp_path, monkeypatch):
    """With DCPX_WRITER_NICE=7 a WriteJob's writer thread runs at nice 7 (seen
    while it waits at a staging gate whose copies the stand-in holds);
    without it, at the process's own."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    t = FakeCudaTensor(lib.devices[0], 4096)
    t.write(random.Random(2).randbytes(4096))
    buf = torch.zeros(4096, dtype=torch.uint8)
    from dcpx.formats.dtypes import dlpack_export, dlpack_view
    for nice in (None, 7):
        if nice is None:
            monkeypatch.delenv("DCPX_WRITER_NICE", raising=False)
        else:
            monkeypatch.setenv("DCPX_WRITER_NICE", str(nice))
        lib.fake_hold_copies(1)
        gate, pending = _C.cuda_copy_into([(t, 0, "k")], buf, wait=False)
        item = (dlpack_export(dlpack_view(buf)), "ByteStorage", gate)
        job = _C.WriteJob([(str(tmp_path / f"w{nice}.bin"), [item])], sync_files=False,
                          threads=1)
        before = set(_thread_nices())
        job.start()
        try:
            _wait_for(lambda: _C.gate_stats(gate)[2] == 1, "the writer waiting at the gate")
            new = {tid: n for tid, n in _thread_nices().items() if tid not in before}
            assert list(new.values()) == [mine if nice is None else max(mine, nice)], new
        finally:
            lib.fake_hold_copies(0)
            _C.cuda_stage_wait(pending)
            job.wait()
        assert t.read() in (tmp_path / f"w{nice}.bin").read_bytes()
    t.free()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_upload_thread_lowers_its_priority_when_asked(monkeypatch):
    from dcpx.api import async_save as _async
    got = {}

    def run(env):
        if env is None:
            monkeypatch.delenv("DCPX_WRITER_NICE", raising=False)
        else:
            monkeypatch.setenv("DCPX_WRITER_NICE", env)
        _async._lower_priority()
        got[env] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for env in (None, "bad", "5"):
        th = threading.Thread(target=run, args=(env,))
        th.start()
        th.join()
    assert got == {None: mine, "bad": mine, "5": max(mine, 5)}
