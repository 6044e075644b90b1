"""A tensor that changes while a synchronous ``save`` writes it (issue 10,
item 2): training goes on in another thread, or an upload that was not
staged.  The values written may be torn, as with torch.save, but the CRC
recorded must be of exactly the bytes written, so a save that reported
success always loads.

The writer reads each tensor byte once, with a fused copy + CRC into a
buffer of its own, and writes that copy (csrc/writer.c).  Before, it CRC'd
the tensor's memory and then wrote that memory again: a change between the
two gave a checkpoint that failed its checksum on load.
"""
import io
import struct
import threading
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx import _C
from conftest import item_slices

REPEAT = 4


class Mutator:
    """In-place adds over the tensors in a tight loop on another thread
    (torch releases the GIL in add_, so it runs alongside the C writer)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.stop = threading.Event()
        self.started = threading.Event()
        self.rounds = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            for t in self.tensors:
                t.add_(1)
                self.started.set()
            self.rounds += 1

    def __enter__(self):
        self.thread.start()
        self.started.wait()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def check_archives(path, md):
    """Every tensor archive's data/0 CRC, in the central directory and in the
    local header, is the CRC of the bytes on disk (parsed by dcpx's C parser
    and by zipfile)."""
    for key, raw, _ in item_slices(path, md):
        info = _C.parse_archive(raw)
        assert info["crc_ok"], f"{key}: recorded CRC is not the data's"
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            [m] = [m for m in z.infolist() if m.filename.endswith("/data/0")]
            local_crc = struct.unpack_from("<I", raw, m.header_offset + 14)[0]
            assert local_crc == m.CRC == info["crc"], key
            assert z.testzip() is None, key


def check_loads(path, sd):
    """Loads with dcpx (CRC verified) and with torch DCP."""
    for load in (lambda d: dcpx.load(d, storage_reader=dcpx.FileSystemReader(path, verify=True)),
                 lambda d: tdcp.load(d, checkpoint_id=path)):
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        load(dest)
        for k, v in dest.items():  # torn values, but each a sum of the adds
            assert torch.isfinite(v).all(), k


@pytest.mark.parametrize("sync_files", [True, False])
def test_large_tensor_mutated_during_save_loads(tmp_path, sync_files):
    # 64 MiB: many 4 MiB chunks, each written while the adds sweep over it.
    sd = {"w": torch.zeros(16 << 20, dtype=torch.float32)}
    for i in range(REPEAT):
        path = tmp_path / f"ckpt{i}"
        with Mutator(list(sd.values())):
            md = dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, sync_files=sync_files))
        check_archives(path, md)
        check_loads(path, sd)


def test_small_tensors_mutated_during_save_load(tmp_path):
    # Small records (<= 1 MiB) go through the batched pwritev path.
    sd = {f"b{i}": torch.zeros(256 << 8, dtype=torch.float32) for i in range(96)}
    sd["strided"] = torch.zeros(512, 512, dtype=torch.float32).t()[:, ::2]
    for i in range(REPEAT):
        path = tmp_path / f"ckpt{i}"
        with Mutator(list(sd.values())):
            md = dcpx.save(sd, storage_writer=dcpx.FileSystemWriter(path, sync_files=False))
        check_archives(path, md)
        check_loads(path, sd)


def test_mutation_stops_before_save_gives_exact_values(tmp_path):
    """The copy the writer writes is the tensor's bytes when nothing changes
    them: bit-exact, every path (large, small, strided)."""
    g = torch.Generator().manual_seed(3)
    sd = {"large": torch.randn(3 << 20, generator=g),
          "small": torch.randn(1000, generator=g),
          "strided": torch.randn(600, 700, generator=g).t(),
          "big_strided": torch.randn(1200, 1100, generator=g)[:, ::3]}
    md = dcpx.save(sd, checkpoint_id=tmp_path)
    check_archives(tmp_path, md)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    dcpx.load(dest, checkpoint_id=tmp_path)
    for k in sd:
        assert torch.equal(dest[k].reshape(-1).view(torch.int32),
                           sd[k].reshape(-1).view(torch.int32)), k
