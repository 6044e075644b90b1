"""dcpx._C.crc32 / crc32_combine: the zip CRC-32 that protects every tensor
record, checked against zlib, the reference implementation.

The C code has a folded (PCLMUL) path for long buffers and a table path for
short ones and for unaligned heads and tails, so lengths and alignments are
swept exhaustively around those boundaries.
"""
import os
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpx import _C

# One random buffer, reused: 16 spare bytes so that any (offset, length)
# with offset < 16 and length <= 4096 is a slice of it.
BUF = os.urandom(4096 + 16 + 64)


def test_reports_which_implementation_it_uses():
    assert isinstance(_C.crc32_impl, str) and _C.crc32_impl


def test_empty_buffer():
    assert _C.crc32(b"") == zlib.crc32(b"") == 0
    assert _C.crc32(b"", 0xDEADBEEF) == zlib.crc32(b"", 0xDEADBEEF)


def test_known_check_value():
    # The standard CRC-32 check value (e.g. Rocksoft model, "CRC-32/ISO-HDLC").
    assert _C.crc32(b"123456789") == 0xCBF43926


@pytest.mark.parametrize("offset", range(16))
def test_every_length_at_every_alignment(offset):
    view = memoryview(BUF)
    for n in range(0, 4097):
        chunk = view[offset:offset + n]
        assert _C.crc32(chunk) == zlib.crc32(chunk), f"offset {offset} length {n}"


@pytest.mark.parametrize("start", [0, 1, 0xFFFFFFFF, 0x12345678, 0x80000000])
def test_running_value_argument(start):
    for n in (0, 1, 7, 15, 16, 17, 63, 64, 65, 255, 256, 1000, 4096):
        data = BUF[3:3 + n]
        assert _C.crc32(data, start) == zlib.crc32(data, start), f"length {n}"


def test_running_value_chains_like_zlib():
    """crc32(b, crc32(a)) == crc32(a + b): how the writer CRCs a tensor
    chunk by chunk."""
    rng = random.Random(7)
    for _ in range(200):
        cut = rng.randrange(0, len(BUF))
        a, b = BUF[:cut], BUF[cut:]
        assert _C.crc32(b, _C.crc32(a)) == zlib.crc32(BUF)


@pytest.mark.parametrize("size", [(1 << 16) + 1, (1 << 20) + 3, (3 << 20) + 17])
def test_large_buffers(size):
    data = os.urandom(size)
    assert _C.crc32(data) == zlib.crc32(data)
    # unaligned large slice, and with a running value
    view = memoryview(data)[5:]
    assert _C.crc32(view, 0xCAFEBABE) == zlib.crc32(view, 0xCAFEBABE)


def test_accepts_any_contiguous_buffer():
    data = bytearray(BUF[:1000])
    assert _C.crc32(data) == zlib.crc32(data)
    assert _C.crc32(memoryview(data)[10:900]) == zlib.crc32(data[10:900])


def test_rejects_non_buffers():
    with pytest.raises(TypeError):
        _C.crc32("a string")
    with pytest.raises(TypeError):
        _C.crc32(12345)


def test_combine_on_random_splits():
    rng = random.Random(11)
    for _ in range(500):
        n = rng.randrange(0, len(BUF))
        data = BUF[:n]
        cut = rng.randrange(0, n + 1)
        a, b = data[:cut], data[cut:]
        got = _C.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert got == zlib.crc32(data), f"split {cut}/{n}"


def test_combine_with_large_second_part():
    a = os.urandom(1000)
    b = os.urandom((2 << 20) + 5)
    assert _C.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_with_empty_parts():
    data = BUF[:333]
    assert _C.crc32_combine(zlib.crc32(data), zlib.crc32(b""), 0) == zlib.crc32(data)
    assert _C.crc32_combine(zlib.crc32(b""), zlib.crc32(data), len(data)) == zlib.crc32(data)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), start=st.integers(0, 2**32 - 1),
       cut=st.integers(0, 3000))
def test_property_matches_zlib(data, start, cut):
    assert _C.crc32(data, start) == zlib.crc32(data, start)
    cut = min(cut, len(data))
    a, b = data[:cut], data[cut:]
    assert _C.crc32_combine(_C.crc32(a), _C.crc32(b), len(b)) == zlib.crc32(data)


@pytest.mark.parametrize("offset", [0, 1, 3, 8, 15])
def test_copy_every_length_matches_zlib_and_copies(offset):
    """crc32_copy: the writer's fused copy + CRC, at every length around the
    folded path's 64/16-byte steps, from unaligned sources into unaligned
    destinations."""
    view = memoryview(BUF)
    for n in list(range(0, 300)) + [1000, 4095, 4096]:
        src = view[offset:offset + n]
        dst = bytearray(n + 8)
        crc = _C.crc32_copy(memoryview(dst)[offset % 7:], src)
        assert crc == zlib.crc32(src), f"offset {offset} length {n}"
        assert dst[offset % 7:offset % 7 + n] == src, f"offset {offset} length {n}"


def test_copy_large_with_running_value():
    data = os.urandom((3 << 20) + 17)
    dst = bytearray(len(data))
    assert _C.crc32_copy(dst, data, 0x1234) == zlib.crc32(data, 0x1234)
    assert dst == data
    with pytest.raises(ValueError):
        _C.crc32_copy(bytearray(3), b"1234")
