"""dcpx's CUDA path on a real GPU (issue 20).  Every test here needs CUDA and
is skipped without it; ``scripts/gpu_check.sh`` runs this file on the GPU
machine (docs/design.md, "CUDA path").

What it checks, each against the real driver (nothing here loads the
stand-in of tests/test_cuda_standin.py):

1. bit-exact save / async_save / load round trips of CUDA tensors of every
   dtype torch.save stores, loaded into CUDA and into CPU tensors;
   non-contiguous tensors, views sharing one storage, 0-d and empty tensors,
   a tensor larger than the 64 MiB pinned load buffer, a cast load into a
   CUDA tensor;
2. ordering: tensors produced by a pending kernel on the current stream,
   on a side stream made current, and an ``async_save`` whose tensors the
   training stream overwrites right after ``staging_completion``;
3. interop with torch DCP both ways for CUDA state dicts, bit exact;
4. a DTensor state dict on a one-GPU mesh (saved by dcpx, loaded by dcpx
   and by torch), in a child process with a one-rank NCCL group;
5. a pinned shared (memfd) staging buffer;
6. 50 async saves with no growth of device memory or of dcpx's host
   registrations;
7. a fork after CUDA use: the child saves and loads CPU tensors without a
   driver call, the parent goes on using CUDA;
8. the manager's node-local tier (docs/tiers.md) on CUDA tensors: local
   pieces, the persistent step assembled from them, resume into CUDA
   tensors, torch DCP reading the persistent step;
9. the load pipeline (issue 30): pieces, runs and ring reuse bit exact
   after a pending kernel, every read through it; resharding reads of one
   byte range through it, column slices, casts and transposed destinations
   through torch's copy_, each reason counted; the batched-copy entry point
   the driver's version calls for; 3,000 small tensors staged and loaded in
   a few batched calls, and one call each without them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from dcpx import _C

from conftest import SAVEABLE_DTYPES, dtype_id, make_tensor

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
TIMEOUT = 120


# --------------------------------------------------------------------------
# helpers: device bytes compared without a copy kernel for the dtype


def to_cuda(t: torch.Tensor) -> torch.Tensor:
    """A CUDA copy of a contiguous CPU tensor of any dtype, moved as bytes
    (torch has no CUDA copy kernel for some dtypes: bits16, float8 ...)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device="cuda")
    return flat.view(torch.uint8).cuda().view(t.dtype).reshape(t.shape)


def host_bytes(t: torch.Tensor) -> bytes:
    """The row-major bytes of a tensor on any device (contiguous ones go as
    bytes; others are made contiguous on their device first)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert host_bytes(actual) == host_bytes(expected), f"bytes differ: {what}"


def empty_like(state: dict, device: str) -> dict:
    return {k: torch.empty(v.shape, dtype=v.dtype, device=device)
            if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def result(x):
    """Wait for an async_save's result (a Future or an AsyncSaveResponse)."""
    if isinstance(x, Future):
        return x.result(timeout=TIMEOUT)
    return x.upload_completion.result(timeout=TIMEOUT)


# --------------------------------------------------------------------------
# 1. round trips


@pytest.mark.parametrize("dtype", SAVEABLE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_every_dtype_round_trips_bit_exact_into_cuda_and_cpu(tmp_path, dtype, how):
    gen = torch.Generator().manual_seed(20)
    host = {"a": make_tensor((257, 3), dtype, gen), "s": make_tensor((), dtype, gen),
            "e": make_tensor((0, 4), dtype, gen)}
    sd = {k: to_cuda(v) for k, v in host.items()}
    ck = tmp_path / "c"
    if how == "save":
        dcpx.save(sd, checkpoint_id=ck)
    else:
        result(dcpx.async_save(sd, checkpoint_id=ck))
    for device in ("cuda", "cpu"):
        out = empty_like(sd, device)
        dcpx.load(out, checkpoint_id=ck)
        for k in host:
            assert out[k].device.type == device
            assert_same(out[k], host[k], f"{k} into {device}")


def test_non_contiguous_views_and_shared_storages_round_trip(tmp_path):
    gen = torch.Generator(device="cuda").manual_seed(4)
    base = torch.randn(64, 48, device="cuda", generator=gen)
    sd = {"base": base, "t": base.t(), "slice": base[3:40:2, 5:],
          "view": base.view(48, 64), "row": base[7],
          "h": torch.randn(33, 17, device="cuda", generator=gen).half().t(),
          "exp": torch.randn(5, 1, device="cuda", generator=gen).expand(5, 9),
          "neg": torch.randn(6, device="cuda", generator=gen).neg().conj(),
          "c": torch.randn(4, 4, dtype=torch.complex64, device="cuda", generator=gen).conj()}
    expected = {k: v.cpu().resolve_conj().resolve_neg().clone() for k, v in sd.items()}
    for how in ("save", "async"):
        ck = tmp_path / how
        if how == "save":
            dcpx.save(sd, checkpoint_id=ck)
        else:
            result(dcpx.async_save(sd, checkpoint_id=ck))
        out = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in expected.items()}
        dcpx.load(out, checkpoint_id=ck)
        for k, v in expected.items():
            assert_same(out[k], v, f"{how}: {k}")


def test_a_tensor_larger_than_the_load_buffer_and_a_cast_load(tmp_path):
    big = torch.randint(-2**31, 2**31 - 1, (40 << 20,), dtype=torch.int32,
                        device="cuda")  # 160 MiB: larger than the 64 MiB pinned buffer
    w = torch.randn(1000, 100, device="cuda")
    dcpx.save({"big": big, "w": w}, checkpoint_id=tmp_path / "c")
    out = {"big": torch.empty_like(big), "w": torch.empty(1000, 100, dtype=torch.bfloat16,
                                                           device="cuda")}
    dcpx.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["big"], big)
    assert torch.equal(out["w"], w.to(torch.bfloat16))


# --------------------------------------------------------------------------
# 2. ordering against the producers' and consumers' streams


@pytest.mark.parametrize("side", [False, True], ids=["current", "side-stream"])
@pytest.mark.parametrize("how", ["save", "stage", "async_save"])
def test_tensors_written_by_a_pending_kernel_are_saved_as_written(tmp_path, side, how):
    """The DLPack handshake: dcpx's copy waits for work queued on the
    stream that is current at the call (the default one, or a side stream
    made current), so a long kernel followed by a fill is saved filled."""
    x = torch.zeros(1 << 22, device="cuda")
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU time queued first
        x.fill_(7.0)
        if how == "save":
            dcpx.save({"x": x}, checkpoint_id=tmp_path / "c")
        elif how == "async_save":
            result(dcpx.async_save({"x": x}, checkpoint_id=tmp_path / "c"))
        else:
            stager = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True))
            staged = stager.stage({"x": x})
            staged = staged.result(timeout=TIMEOUT) if isinstance(staged, Future) else staged
            assert torch.equal(staged["x"], torch.full((1 << 22,), 7.0))
            stager.close()
            return
    out = {"x": torch.empty(1 << 22)}
    dcpx.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["x"], torch.full((1 << 22,), 7.0))


@pytest.mark.parametrize("stager", [False, True], ids=["own-buffers", "stager"])
def test_overwrites_right_after_staging_completion_do_not_reach_the_checkpoint(tmp_path,
                                                                                stager):
    sd = {f"w{i}": torch.randn(256, 1024, device="cuda") for i in range(32)}
    expected = {k: v.cpu().clone() for k, v in sd.items()}
    st = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)) if stager else None
    r = dcpx.async_save(sd, checkpoint_id=tmp_path / "c",
                        **({"async_stager": st} if st is not None else {}))
    if not isinstance(r, Future):
        r.staging_completion.result(timeout=TIMEOUT)
    for v in sd.values():  # the training stream, at once
        v.mul_(-1).add_(3)
    result(r)
    if st is not None:
        st.close()
    out = empty_like(sd, "cpu")
    dcpx.load(out, checkpoint_id=tmp_path / "c")
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


def test_a_load_is_seen_by_the_consumers_later_kernels(tmp_path):
    src = torch.arange(1 << 22, dtype=torch.float32)
    dcpx.save({"x": src}, checkpoint_id=tmp_path / "c")
    x = torch.zeros(1 << 22, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.fill_(-1.0)  # pending when the load starts: the load must come after it
        dcpx.load({"x": x}, checkpoint_id=tmp_path / "c")
        y = x * 2  # queued on the consumer stream after the load
    side.synchronize()
    assert torch.equal(x.cpu(), src)
    assert torch.equal(y.cpu(), src * 2)


# --------------------------------------------------------------------------
# 3. torch DCP interop, both ways


def _mixed_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    host = {"f32": torch.randn(300, 7, generator=gen),
            "bf16": torch.randn(64, 64, generator=gen).bfloat16(),
            "i64": torch.randint(-2**62, 2**62, (1000,), generator=gen),
            "u8": torch.randint(0, 256, (17,), dtype=torch.uint8, generator=gen),
            "b": torch.rand(10, generator=gen) > 0.5, "s": torch.tensor(3.5)}
    return host


@pytest.mark.parametrize("writer", ["dcpx", "torch"])
def test_cuda_state_dicts_move_between_dcpx_and_torch_dcp(tmp_path, writer):
    host = _mixed_state(7)
    sd = {k: v.cuda() for k, v in host.items()}
    sd["step"] = 11
    ck = str(tmp_path / "c")
    (dcpx if writer == "dcpx" else tdcp).save(sd, checkpoint_id=ck)
    reader = tdcp if writer == "dcpx" else dcpx
    out = empty_like(sd, "cuda")
    out["step"] = 0
    reader.load(out, checkpoint_id=ck)
    assert out["step"] == 11
    for k, v in host.items():
        assert_same(out[k], v, f"{writer}->{reader.__name__}: {k}")


# --------------------------------------------------------------------------
# 4. DTensor on one GPU (one-rank NCCL group, in a child process)


_DTENSOR_CHILD = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    import dcpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                            world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    gen = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}
    sd = {"w": distribute_tensor(full["w"].cuda(), mesh, [Shard(0)]),
          "b": distribute_tensor(full["b"].cuda(), mesh, [Replicate()])}
    dcpx.save(sd, checkpoint_id=sys.argv[1])
    for lib in (dcpx, tdcp):
        out = {k: distribute_tensor(torch.zeros_like(v).cuda(), mesh, p)
               for (k, v), p in zip(full.items(), ([Shard(0)], [Replicate()]))}
        lib.load(out, checkpoint_id=sys.argv[1])
        for k, v in full.items():
            assert torch.equal(out[k].full_tensor().cpu(), v), (lib.__name__, k)
    plain = {k: torch.zeros_like(v) for k, v in full.items()}
    dcpx.load(plain, checkpoint_id=sys.argv[1])
    assert all(torch.equal(plain[k], full[k]) for k in full)
    dist.destroy_process_group()
    print("dtensor: ok")
""")


def test_a_dtensor_state_dict_on_one_gpu(tmp_path):
    r = subprocess.run([sys.executable, "-c", _DTENSOR_CHILD, str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=TIMEOUT,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and "dtensor: ok" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------
# 5. a pinned shared (memfd) staging buffer


def test_a_pinned_shared_staging_buffer_is_registered_and_released(tmp_path):
    sd = {f"w{i}": torch.randn(1024, 1024, device="cuda") for i in range(8)}
    before = _C.cuda_registered()
    st = dcpx.DefaultStager(dcpx.StagingOptions(use_pinned_memory=True,
                                                use_shared_memory=True,
                                                use_async_staging=True))
    r = dcpx.async_save(sd, checkpoint_id=tmp_path / "c", async_stager=st)
    result(r)
    assert st._layout.buffer.pinned is True
    count, nbytes = _C.cuda_registered()
    assert count == before[0] + 1 and nbytes - before[1] >= 8 * 4 << 20
    st.close()
    assert _C.cuda_registered() == before
    out = empty_like(sd, "cuda")
    dcpx.load(out, checkpoint_id=tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


# --------------------------------------------------------------------------
# 6. no growth over many saves


@pytest.mark.parametrize("stager", [False, True], ids=["own-buffers", "stager"])
def test_fifty_async_saves_leave_device_memory_and_registrations_flat(tmp_path, stager):
    sd = {f"w{i}": torch.randn(512, 512, device="cuda") for i in range(16)}
    st = dcpx.DefaultStager(dcpx.StagingOptions(use_async_staging=True)) if stager else None
    kw = {"async_stager": st} if st is not None else {}
    result(dcpx.async_save(sd, checkpoint_id=tmp_path / "warm", **kw))
    torch.cuda.synchronize()
    dev0, reg0 = torch.cuda.memory_allocated(), _C.cuda_registered()
    for i in range(50):
        result(dcpx.async_save(sd, checkpoint_id=tmp_path / f"s{i % 3}", **kw))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == dev0
    assert _C.cuda_registered() == reg0
    if st is not None:
        st.close()
    out = empty_like(sd, "cpu")
    dcpx.load(out, checkpoint_id=tmp_path / "s2")
    assert all(torch.equal(out[k], v.cpu()) for k, v in sd.items())


# --------------------------------------------------------------------------
# 7. fork after CUDA use


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_after_cuda_use(tmp_path):
    x = torch.randn(1 << 20, device="cuda")
    result(dcpx.async_save({"x": x}, checkpoint_id=tmp_path / "parent0"))
    pid = os.fork()
    if pid == 0:  # the child: CPU work only, no driver call allowed
        code = 1
        try:
            cpu = {"y": torch.arange(1000)}
            dcpx.save(cpu, checkpoint_id=str(tmp_path / "child"))
            out = {"y": torch.zeros(1000, dtype=torch.int64)}
            dcpx.load(out, checkpoint_id=str(tmp_path / "child"))
            code = 0 if torch.equal(out["y"], cpu["y"]) else 2
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    x.add_(1)
    result(dcpx.async_save({"x": x}, checkpoint_id=tmp_path / "parent1"))
    out = {"x": torch.empty_like(x)}
    dcpx.load(out, checkpoint_id=tmp_path / "parent1")
    assert torch.equal(out["x"], x)


def test_the_node_local_tier_with_cuda_tensors(tmp_path):
    """CheckpointManager(local_root=...) on CUDA tensors (docs/tiers.md):
    the local pieces and the persistent step assembled from them hold the
    device values bit-exactly, resume loads them back into CUDA tensors,
    and torch DCP reads the persistent step."""
    def sd(step):
        g = torch.Generator(device="cuda").manual_seed(step)
        return {"w": torch.randn(1 << 16, device="cuda", generator=g),
                "b": torch.arange(100, device="cuda") * step, "step": step}
    m = dcpx.CheckpointManager(tmp_path / "root", local_root=tmp_path / "local",
                               persist_interval_steps=2)
    for step in (1, 2, 3):
        resp = m.save(step, sd(step))
        getattr(resp, "staging_completion", resp).result()
    m.close()
    assert m.all_steps() == [2] and m.local_steps() == [2, 3]
    m = dcpx.CheckpointManager(tmp_path / "root", local_root=tmp_path / "local",
                               persist_interval_steps=2)
    out = {"w": torch.zeros(1 << 16, device="cuda"),
           "b": torch.zeros(100, dtype=torch.int64, device="cuda"), "step": 0}
    assert m.load(out) == 3 and m.last_resume["tier"] == "local"
    want = sd(3)
    assert_same(out["w"], want["w"], "w")
    assert_same(out["b"], want["b"], "b")
    m.close()
    tout = {"w": torch.zeros(1 << 16, device="cuda"),
            "b": torch.zeros(100, dtype=torch.int64, device="cuda"), "step": 0}
    tdcp.load(tout, checkpoint_id=str(tmp_path / "root" / "step-2"))
    assert_same(tout["w"], sd(2)["w"], "torch w")
    assert tout["step"] == 2


# --------------------------------------------------------------------------
# 9. the load pipeline (csrc/cuda_pipeline.c) and batched copies (issue 30)


def _reader_load(out: dict, ck) -> dcpx.FileSystemReader:
    reader = dcpx.FileSystemReader(ck)
    dcpx.load(out, storage_reader=reader)
    torch.cuda.synchronize()
    return reader


def test_loads_into_cuda_tensors_go_through_the_pipeline_and_say_so(tmp_path):
    """Tensors longer than a slot (pieces), small ones (runs), 200 MB (more
    than the 64 MiB ring: slots reused), several dtypes: bit exact, after a
    pending kernel on the current stream writing the destinations, every
    read through the pipeline."""
    gen = torch.Generator(device="cuda").manual_seed(30)
    sd = {"big": torch.randint(-2**31, 2**31 - 1, (50 << 20,), dtype=torch.int32,
                               device="cuda", generator=gen),
          "mid": torch.randn(3 << 20, device="cuda", generator=gen),
          "bf": torch.randn(999, 7, device="cuda", generator=gen).bfloat16(),
          **{f"s{i}": torch.randn(13 + i, device="cuda", generator=gen) for i in range(50)}}
    ck = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=ck)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    torch.cuda._sleep(50_000_000)
    for v in out.values():
        v.fill_(7)  # pending on the current stream when the load starts
    reader = _reader_load(out, ck)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    st = reader.cuda_load_stats
    assert st["pipeline"] == len(sd) and "torch_copy" not in st, st
    ps = st["pipeline_stats"]
    assert ps["pieces"] > 50 and ps["slot_reuses"] > 0 and ps["pinned"], ps
    assert _C.cuda_registered()[0] >= 1


def test_resharding_casts_and_non_contiguous_destinations_load_bit_exact(tmp_path):
    """A part of a saved chunk that is one byte range goes through the
    pipeline; a column slice, a cast and a transposed destination through
    torch's copy_; the stats name each reason."""
    from dcpx.storage.reader import _TensorRead
    gen = torch.Generator(device="cuda").manual_seed(31)
    sd = {"rows": torch.randn(4096, 256, device="cuda", generator=gen),
          "cols": torch.randn(64, 32, device="cuda", generator=gen),
          "cast": torch.randn(1000, device="cuda", generator=gen),
          "t": torch.randn(48, 64, device="cuda", generator=gen)}
    ck = tmp_path / "c"
    dcpx.save(sd, checkpoint_id=ck)
    reader = dcpx.FileSystemReader(ck)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    info = {k.fqn: v for k, v in md.storage_data.items()}
    rows = torch.zeros(1000, 256, device="cuda")
    cols = torch.zeros(64, 10, device="cuda")
    cast = torch.zeros(1000, dtype=torch.float64, device="cuda")
    t = torch.zeros(64, 48, device="cuda").t()
    reader.read_tensors([
        _TensorRead("rows", info["rows"], sd["rows"].shape, torch.float32, rows,
                    ((3000, 0), (1000, 256))),
        _TensorRead("cols", info["cols"], sd["cols"].shape, torch.float32, cols,
                    ((0, 20), (64, 10))),
        _TensorRead("cast", info["cast"], sd["cast"].shape, torch.float32, cast, None),
        _TensorRead("t", info["t"], sd["t"].shape, torch.float32, t, None)])
    torch.cuda.synchronize()
    assert torch.equal(rows, sd["rows"][3000:4000])
    assert torch.equal(cols, sd["cols"][:, 20:30])
    assert torch.equal(cast, sd["cast"].double())
    assert torch.equal(t, sd["t"])
    st = reader.cuda_load_stats
    assert st["pipeline"] == 1 and st["torch_copy"] == 3
    assert st["torch_copy_reasons"] == {"part of the chunk not one byte range": 1,
                                        "dtype cast": 1, "non-contiguous destination": 1}


def test_the_batch_entry_point_follows_the_driver_version():
    version, _ = _C.cuda_driver_version()
    api = _C.cuda_batch_copies()
    want = ("cuMemcpyBatchAsync_v2" if version >= 13000 else
            "cuMemcpyBatchAsync" if version >= 12080 else None)
    assert api == want, (version, api)
    assert _C.cuda_copy_stats()["batch_api"] == want


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-copy"])
def test_many_small_tensors_stage_and_load_in_few_calls(tmp_path, batched):
    """3,000 small tensors staged and loaded: bit exact both ways; with
    batched copies (where the driver has them) a few calls, else one per
    tensor."""
    api = _C.cuda_batch_copies()
    if batched and api is None:
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
    gen = torch.Generator(device="cuda").manual_seed(32)
    sd = {f"p{i}": torch.randn(64 + i % 97, device="cuda", generator=gen) for i in range(3000)}
    _C.cuda_batch_copies(batched)
    try:
        before = _C.cuda_copy_stats()
        with dcpx.DefaultStager(dcpx.StagingOptions(True, False, False, True)) as stager:
            staged = stager.stage(sd)
            for k, v in sd.items():
                assert torch.equal(staged[k], v.cpu()), k
            mid = _C.cuda_copy_stats()
            dcpx.save(staged, checkpoint_id=tmp_path / "c")
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader = _reader_load(out, tmp_path / "c")
        after = _C.cuda_copy_stats()
    finally:
        _C.cuda_batch_copies(True)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    ps = reader.cuda_load_stats["pipeline_stats"]
    if batched:
        assert 1 <= mid["batch_dtoh_calls"] - before["batch_dtoh_calls"] <= 10
        assert mid["dtoh_calls"] - before["dtoh_calls"] <= 5
        assert 1 <= ps["batch_calls"] <= 50 and ps["batched_copies"] == 3000, ps
    else:
        assert mid["batch_dtoh_calls"] == before["batch_dtoh_calls"]
        assert ps["batch_calls"] == 0 and ps["htod_calls"] == 3000, ps
    assert after["batch_api"] == api
