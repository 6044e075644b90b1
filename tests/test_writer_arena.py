"""The C writer builds every archive's head and tail in its batch arena,
where they are written, between the alignment gap and the tensor's copied
bytes (csrc/writer.c ``batch_reserve``/``write_small``/``write_large``).
These tests mix what moves the arena around: small records that fill and
flush it, records over 1 MiB that bypass it (their tail continues the next
batch), non-tensor values that are written from their own memory (breaking
the arena's contiguous run), non-contiguous tensors, and the longest heads
(64 dims).  Every record must be a valid zip with the right CRCs, its
tensor bytes 64-byte aligned in the file, and load bit-exactly in dcpx and
in torch DCP."""
import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpx
from conftest import item_slices, member_data_offset

KINDS = ("small", "tiny", "large", "value", "strided", "deep", "empty")


def _value(kind: str, i: int, g: torch.Generator):
    if kind == "small":
        return torch.randn(int(torch.randint(1, 5000, (1,), generator=g)), generator=g)
    if kind == "tiny":
        return torch.randn((), generator=g) if i % 2 else torch.arange(i % 7 + 1, dtype=torch.int16)
    if kind == "large":  # > 1 MiB: streamed past the arena, head written last
        return torch.randn(300_000 + i, generator=g)
    if kind == "value":  # a non-tensor: its bytes come from a Python bytes object
        return f"step {i} " + "x" * (i % 300)
    if kind == "strided":
        return torch.randn(40, 33, generator=g).t()[:, ::2]
    if kind == "deep":  # the longest pickle dcpx writes: 64 dims
        return torch.randn(*([1] * 62 + [2, 3]), generator=g)
    return torch.empty(0, 5)


def _check(path, state, md):
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    seen = set()
    for key, raw, offset in item_slices(path, md):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            assert z.testzip() is None, f"{key}: bad CRC"
        if key in tensors:
            start = offset + member_data_offset(raw, "/data/0")[0]
            assert start % 64 == 0, f"{key}: tensor data at file offset {start}"
        seen.add(key)
    assert seen == set(state)
    for lib in (dcpx, tdcp):
        dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                for k, v in state.items()}
        lib.load(dest, checkpoint_id=path)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(dest[k], v), (lib.__name__, k)
                assert dest[k].numpy().tobytes() == v.contiguous().numpy().tobytes()
            else:
                assert dest[k] == v, (lib.__name__, k)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=40),
       threads=st.sampled_from([1, 2]))
def test_any_mix_of_records_is_valid_and_loads(tmp_path_factory, kinds, threads):
    g = torch.Generator().manual_seed(len(kinds))
    state = {f"k{i}.{kind}": _value(kind, i, g) for i, kind in enumerate(kinds)}
    path = tmp_path_factory.mktemp("mix")
    md = dcpx.save(state, storage_writer=dcpx.FileSystemWriter(path, thread_count=threads))
    _check(path, state, md)


@pytest.mark.parametrize("pattern", ["values-between", "large-between", "many-small"])
def test_arena_flushes_and_runs(tmp_path, pattern):
    """Enough records to flush the 2 MiB arena and the 1020-iovec batch many
    times over, with the run broken every few records."""
    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(3000 if pattern == "many-small" else 600):
        state[f"s{i}"] = torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g)
        if pattern == "values-between" and i % 3 == 0:
            state[f"v{i}"] = "y" * (i % 50)
        if pattern == "large-between" and i % 97 == 0:
            state[f"L{i}"] = torch.randn(262_145 + i, generator=g)
    md = dcpx.save(state, checkpoint_id=tmp_path)
    _check(tmp_path, state, md)
    assert sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)) > 0
