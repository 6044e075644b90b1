"""Optional: dcpx.fsspec against a local S3 server (moto on 127.0.0.1, never
the internet).  Skipped unless ``moto[server]`` and ``s3fs`` are installed;
they are not in scripts/setup.sh (about 300 MB of dependencies):
``pip install "moto[server]" s3fs`` to run it."""
from __future__ import annotations

import os
import socket
import uuid

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import dcpx
from conftest import assert_state_bit_equal

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 and a bucket; yields the storage
    options and sets the environment so plain ``s3://`` ids reach it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    opts = dict(endpoint_url=endpoint, key="testing", secret="testing")
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"dcpx-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    try:
        yield bucket, opts
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


def _state():
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 33, generator=g), "i": torch.arange(100), "step": 3,
            "h": torch.randn(17, generator=g).half()}


def _empty():
    return {"w": torch.zeros(64, 33), "i": torch.zeros(100, dtype=torch.long), "step": 0,
            "h": torch.zeros(17).half()}


def test_s3_save_load_with_storage_options(s3, tmp_path, monkeypatch):
    from dcpx.fsspec import FsspecReader, FsspecWriter
    monkeypatch.chdir(tmp_path)
    bucket, opts = s3
    url = f"s3://{bucket}/opts/step1"
    sd = _state()
    dcpx.save(sd, storage_writer=FsspecWriter(url, thread_count=2, **opts))
    dcpx.save(sd, storage_writer=FsspecWriter(url, single_file_per_rank=False, **opts))
    out = _empty()
    dcpx.load(out, storage_reader=FsspecReader(url, **opts))
    assert_state_bit_equal(out, sd)
    assert os.listdir(tmp_path) == []


def test_s3_checkpoint_id_routing_and_interop(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bucket, _ = s3
    sd = _state()
    ours, theirs = f"s3://{bucket}/ids/dcpx", f"s3://{bucket}/ids/torch"
    dcpx.async_save(sd, checkpoint_id=ours).result(timeout=120)
    tdcp.save(sd, checkpoint_id=theirs)
    for load in (dcpx.load, tdcp.load):
        for url in (ours, theirs):
            out = _empty()
            load(out, checkpoint_id=url)
            assert_state_bit_equal(out, sd)
    assert os.listdir(tmp_path) == []


def test_s3_resave_in_place_between_turns_is_refused(s3, tmp_path, monkeypatch):
    """Issue 31, item 2 on S3: torch's FsspecWriter rewrites __0_0.distcp
    between two turns of a dcpx load; the object's ETag changes and the load
    is refused naming it (before: the values of two saves, no error)."""
    from test_fsspec_pinned import _state, rewrite_between_turns
    monkeypatch.chdir(tmp_path)
    bucket, opts = s3
    url = f"s3://{bucket}/pinned/step1"
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchWriter

    def torch_save(v: float) -> None:
        tdcp.save(_state(v), storage_writer=TorchWriter(url, **opts))

    torch_save(100.0)
    with pytest.raises(dcpx.CorruptCheckpointError) as e:
        got = rewrite_between_turns(monkeypatch, url, lambda: torch_save(200.0), **opts)
        pytest.fail(f"loaded values of saves {got} without an error")
    assert f"{url}/__0_0.distcp" in str(e.value) and "ETag" in str(e.value), str(e.value)
