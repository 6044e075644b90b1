"""``import dcpx as dcp`` is torch.distributed.checkpoint's namespace, and
its failures are caught the way torch's are (issue 10, item 11).

* every public name of the installed ``torch.distributed.checkpoint``
  (modules aside) exists in dcpx and its ``__all__``; names dcpx does not
  replace are torch's own objects; the functions and classes it replaces
  accept torch's arguments and subclass torch's protocols;
* ``save_state_dict`` / ``load_state_dict`` behave as torch's deprecated
  forms (FutureWarning, storage objects, no Stateful handling, no_dist not
  inferred);
* for each failure that torch 2.13 reports as ``CheckpointException`` (checked
  here against torch itself, in one process and on 2 ranks), ``except
  CheckpointException`` catches dcpx's error, which keeps its own class,
  message (key and file) and errno; argument errors torch raises bare stay
  bare.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import traceback
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import CheckpointException

import dcpx

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parent.parent

#: names whose dcpx object is dcpx's own (the rest must be torch's)
REPLACED = {"save", "load", "async_save", "save_state_dict", "load_state_dict",
            "FileSystemWriter", "FileSystemReader"}


def torch_public_names() -> list:
    names = getattr(tdcp, "__all__", None) or [n for n in dir(tdcp) if not n.startswith("_")]
    return sorted(n for n in names if not isinstance(getattr(tdcp, n), types.ModuleType))


# --------------------------------------------------------------------------
# the namespace

def test_every_public_torch_name_is_in_dcpx():
    names = torch_public_names()
    assert {"CheckpointException", "DefaultSavePlanner", "SavePlan", "StorageReader",
            "load_state_dict", "save_state_dict"} <= set(names)  # the test sees them
    missing = [n for n in names if not hasattr(dcpx, n)]
    assert not missing, f"torch.distributed.checkpoint names missing from dcpx: {missing}"
    not_exported = [n for n in names if n not in dcpx.__all__]
    assert not not_exported, f"not in dcpx.__all__: {not_exported}"
    assert all(hasattr(dcpx, n) for n in dcpx.__all__)


@pytest.mark.parametrize("name", sorted(set(torch_public_names()) - REPLACED))
def test_names_dcpx_does_not_replace_are_torchs_objects(name):
    assert getattr(dcpx, name) is getattr(tdcp, name)


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_replaced_callables_accept_torchs_arguments(name):
    """Every parameter of torch's exists in dcpx's, of the same kind and
    default (constructors of the storage classes included)."""
    ours, theirs = getattr(dcpx, name), getattr(tdcp, name)
    assert ours is not theirs
    ps = inspect.signature(ours).parameters
    for p in inspect.signature(theirs).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert p.name in ps or any(q.kind == q.VAR_KEYWORD for q in ps.values()), (
            f"dcpx.{name} lacks torch's parameter {p.name!r}")
        if p.name in ps:
            q = ps[p.name]
            assert q.kind == p.kind, f"dcpx.{name}({p.name}): {q.kind} != torch's {p.kind}"
            if p.default is not p.empty and isinstance(p.default, (bool, int, str, type(None))):
                assert q.default == p.default, (
                    f"dcpx.{name}({p.name}={q.default!r}): torch's default is {p.default!r}")


def test_replaced_classes_are_torchs_protocols_and_errors_are_checkpoint_exceptions():
    assert issubclass(dcpx.FileSystemWriter, tdcp.StorageWriter)
    assert issubclass(dcpx.FileSystemReader, tdcp.StorageReader)
    assert dcpx.CheckpointException is CheckpointException
    for cls in (dcpx.CheckpointError, dcpx.CorruptCheckpointError,
                dcpx.IncompleteCheckpointError, dcpx.UnsafeCheckpointError):
        assert issubclass(cls, CheckpointException) and issubclass(cls, Exception), cls
    assert issubclass(dcpx.IncompleteCheckpointError, FileNotFoundError)
    e = dcpx.CorruptCheckpointError("ck/__0_0.distcp: key 'w': bad")
    assert str(e) == "ck/__0_0.distcp: key 'w': bad"  # not torch's traceback dump
    [(rank, (exc, summary))] = e.failures.items()   # torch's {rank: (exc, traceback)}
    assert rank == 0 and exc is e and isinstance(summary, traceback.StackSummary)


# --------------------------------------------------------------------------
# deprecated save_state_dict / load_state_dict

class Counter:
    """A Stateful: dcpx.save calls state_dict(); the deprecated forms do
    not (torch pickles the object itself)."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": torch.tensor([self.n])}

    def load_state_dict(self, sd):
        self.n = int(sd["n"])


@pytest.mark.parametrize("lib", ["torch", "dcpx"])
def test_deprecated_aliases_behave_as_torchs(tmp_path, lib):
    m = tdcp if lib == "torch" else dcpx
    sd = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    path = str(tmp_path / "ck")
    with pytest.warns(FutureWarning, match="save_state_dict` is deprecated"):
        md = m.save_state_dict(sd, m.FileSystemWriter(path), no_dist=True)
    assert set(md.state_dict_metadata) == {"w", "step"}
    out = {"w": torch.zeros(2, 3), "step": None}
    with pytest.warns(FutureWarning, match="load_state_dict` is deprecated"):
        m.load_state_dict(out, m.FileSystemReader(path), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 7
    # no_dist is not inferred: without a process group both refuse
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            m.save_state_dict(sd, m.FileSystemWriter(str(tmp_path / "ck2")))
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            m.load_state_dict(out, m.FileSystemReader(path))
        # a Stateful is saved as the object itself, not its state_dict()
        md = m.save_state_dict({"c": Counter(3)}, m.FileSystemWriter(str(tmp_path / "ck3")),
                               no_dist=True)
        assert isinstance(md.state_dict_metadata["c"], dcpx.BytesStorageMetadata)


def test_dcpx_files_written_by_deprecated_save_load_with_torch(tmp_path):
    sd = {"w": torch.arange(6.0), "step": 3}
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcpx.save_state_dict(sd, dcpx.FileSystemWriter(path), no_dist=True)
    out = {"w": torch.zeros(6), "step": None}
    tdcp.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3


# --------------------------------------------------------------------------
# failures: caught as torch's CheckpointException

def _checkpoint(path, sd=None):
    tdcp.save(sd or {"w": torch.arange(1024.0), "step": 3}, checkpoint_id=path)
    return path


def _data_file(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".distcp"))[0]


def case_load_missing_directory(m, tmp):
    m.load({"w": torch.zeros(1024)}, checkpoint_id=os.path.join(tmp, "nope"))


def case_load_directory_without_metadata(m, tmp):
    os.makedirs(os.path.join(tmp, "empty"))
    m.load({"w": torch.zeros(1024)}, checkpoint_id=os.path.join(tmp, "empty"))


def case_load_corrupt_metadata(m, tmp):
    p = _checkpoint(os.path.join(tmp, "ck"))
    with open(os.path.join(p, ".metadata"), "r+b") as f:
        f.write(b"garbage")
    m.load({"w": torch.zeros(1024)}, checkpoint_id=p)


def case_load_truncated_data_file(m, tmp):
    p = _checkpoint(os.path.join(tmp, "ck"))
    os.truncate(os.path.join(p, _data_file(p)), 100)
    m.load({"w": torch.zeros(1024)}, checkpoint_id=p)


def case_load_missing_data_file(m, tmp):
    p = _checkpoint(os.path.join(tmp, "ck"))
    os.unlink(os.path.join(p, _data_file(p)))
    m.load({"w": torch.zeros(1024)}, checkpoint_id=p)


def case_load_missing_key(m, tmp):
    p = _checkpoint(os.path.join(tmp, "ck"))
    m.load({"w": torch.zeros(1024), "absent": torch.zeros(1)}, checkpoint_id=p)


def case_load_shape_mismatch(m, tmp):
    p = _checkpoint(os.path.join(tmp, "ck"))
    m.load({"w": torch.zeros(1000)}, checkpoint_id=p)


def case_save_unpicklable_value(m, tmp):
    m.save({"w": torch.ones(2), "fn": lambda x: x}, checkpoint_id=os.path.join(tmp, "ck"))


def case_save_path_is_a_file(m, tmp):
    p = os.path.join(tmp, "file")
    open(p, "w").close()
    m.save({"w": torch.ones(2)}, checkpoint_id=p)


def case_save_meta_tensor(m, tmp):
    m.save({"w": torch.empty(3, device="meta")}, checkpoint_id=os.path.join(tmp, "ck"))


def case_async_save_unpicklable_value(m, tmp):
    m.async_save({"w": torch.ones(2), "fn": lambda x: x},
                 checkpoint_id=os.path.join(tmp, "ck")).result(60)


#: case -> (what dcpx's error also is, text its message names)
CASES = {
    case_load_missing_directory: (dcpx.IncompleteCheckpointError, "nope"),
    case_load_directory_without_metadata: (FileNotFoundError, ".metadata"),
    case_load_corrupt_metadata: (dcpx.CorruptCheckpointError, ".metadata"),
    case_load_truncated_data_file: (dcpx.CorruptCheckpointError, "truncated"),
    case_load_missing_data_file: (dcpx.CorruptCheckpointError, "__0_0.distcp"),
    case_load_missing_key: (RuntimeError, "absent"),
    case_load_shape_mismatch: (ValueError, "Size mismatch"),
    case_save_unpicklable_value: (TypeError, "'fn'"),
    case_save_path_is_a_file: (NotADirectoryError, "file"),
    case_save_meta_tensor: (ValueError, "'w'"),
    case_async_save_unpicklable_value: (TypeError, "'fn'"),
}


def _raised(fn):
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's is a BaseException
        return e
    return None


def _torch_loads_mismatch() -> bool:
    """Whether the installed torch loads a saved (3,) tensor into a (4,) one
    without an error (torch 2.4 does)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": torch.ones(3)}, checkpoint_id=d)
        return _raised(lambda: tdcp.load({"w": torch.zeros(4)}, checkpoint_id=d)) is None


_TORCH_LOADS_MISMATCH = _torch_loads_mismatch()


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: c.__name__[5:])
def test_except_checkpoint_exception_catches_dcpx_failures(tmp_path, case):
    (tmp_path / "torch").mkdir()
    (tmp_path / "dcpx").mkdir()
    theirs = _raised(lambda: case(tdcp, str(tmp_path / "torch")))
    if not (theirs is None and case is case_load_shape_mismatch and _TORCH_LOADS_MISMATCH):
        assert isinstance(theirs, CheckpointException), f"torch raised {theirs!r}"
    # else: torch 2.4 loads a smaller saved tensor into a bigger one without
    # a word (silent wrong data); dcpx refuses it on every torch (below).
    ours = _raised(lambda: case(dcpx, str(tmp_path / "dcpx")))
    also, text = CASES[case]
    assert isinstance(ours, CheckpointException), f"dcpx raised {type(ours).__mro__}: {ours}"
    assert isinstance(ours, also), f"dcpx raised {type(ours).__name__}, not a {also.__name__}"
    assert isinstance(ours, Exception)
    assert text in str(ours), str(ours)
    [(rank, (exc, _))] = ours.failures.items()
    assert rank == 0 and isinstance(exc, also) and str(exc) == str(ours)
    try:  # the way user code catches torch's
        raise ours
    except CheckpointException:
        pass


def test_argument_errors_stay_bare_as_in_torch(tmp_path):
    """torch raises these before its checkpoint steps, not wrapped."""
    for m in (tdcp, dcpx):
        e = _raised(lambda: m.save({"w": torch.ones(1)}))
        assert type(e) is RuntimeError and "checkpoint_id" in str(e), (m, e)
        e = _raised(lambda: m.load({"w": torch.ones(1)}))
        assert type(e) is RuntimeError and "checkpoint_id" in str(e), (m, e)


_WRITE_ERROR_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint import CheckpointException
    import dcpx
    root = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG, not a signal
    sd = {"w": torch.arange(1 << 19, dtype=torch.float32)}   # 2 MiB
    out = {}
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    for lib, m in (("torch", tdcp), ("dcpx", dcpx)):
        for how in ("save", "async_save"):
            path = os.path.join(root, f"{lib}-{how}")
            try:
                if how == "save":
                    m.save(sd, checkpoint_id=path)
                else:
                    m.async_save(sd, checkpoint_id=path).result(60)
                out[f"{lib}-{how}"] = None
            except BaseException as e:
                out[f"{lib}-{how}"] = {
                    "checkpoint_exception": isinstance(e, CheckpointException),
                    "oserror": isinstance(e, OSError), "errno": getattr(e, "errno", None),
                    "filename": getattr(e, "filename", None), "message": str(e)[-400:]}
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGXFSZ"), reason="no SIGXFSZ")
def test_real_write_error_is_a_checkpoint_exception_and_an_oserror(tmp_path):
    """RLIMIT_FSIZE makes the data file's write fail with EFBIG (in a child)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard <= 1 << 20:
        pytest.skip("RLIMIT_FSIZE not usable here")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", _WRITE_ERROR_CHILD, str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for how in ("save", "async_save"):
        assert res[f"torch-{how}"]["checkpoint_exception"], res
        ours = res[f"dcpx-{how}"]
        assert ours["checkpoint_exception"] and ours["oserror"], (how, ours)
        assert ours["errno"] == 27 and ours["filename"].endswith(".distcp"), (how, ours)  # EFBIG


# --------------------------------------------------------------------------
# on 2 ranks

def _multi_rank(rank, world_size, workdir):
    """Each case with torch and with dcpx, on every rank: whether it raised a
    CheckpointException (and dcpx's message)."""
    import torch.distributed as dist

    def save_bad_value_on_rank_1(m, path):
        m.save({"w": torch.ones(4), "v": (lambda x: x) if rank == 1 else 1},
               checkpoint_id=path)

    def async_save_bad_value_on_rank_1(m, path):
        m.async_save({"w": torch.ones(4), "v": (lambda x: x) if rank == 1 else 1},
                     checkpoint_id=path).result(120)

    def load_missing_checkpoint(m, path):
        m.load({"w": torch.zeros(4)}, checkpoint_id=path)

    def load_key_missing_on_rank_1(m, path):
        tdcp.save({"w": torch.ones(4)}, checkpoint_id=path)
        dist.barrier()
        sd = {"w": torch.zeros(4)}
        if rank == 1:
            sd["absent"] = torch.zeros(1)
        m.load(sd, checkpoint_id=path)

    def load_corrupt_metadata(m, path):
        tdcp.save({"w": torch.ones(4)}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(path, ".metadata"), "r+b") as f:
                f.write(b"garbage")
        dist.barrier()
        m.load({"w": torch.zeros(4)}, checkpoint_id=path)

    out = {}
    for case in (save_bad_value_on_rank_1, async_save_bad_value_on_rank_1,
                 load_missing_checkpoint, load_key_missing_on_rank_1, load_corrupt_metadata):
        for lib, m in (("torch", tdcp), ("dcpx", dcpx)):
            dist.barrier()
            e = _raised(lambda: case(m, os.path.join(workdir, f"{case.__name__}-{lib}")))
            out[f"{case.__name__}/{lib}"] = (
                isinstance(e, CheckpointException), type(e).__name__, str(e)[-300:])
    return out


@pytest.mark.dist
def test_except_checkpoint_exception_catches_dcpx_failures_on_every_rank(tmp_path):
    from dist_helpers import spawn
    results = spawn(_multi_rank, 2, str(tmp_path))
    for rank, res in enumerate(results):
        for key, (caught, name, msg) in res.items():
            assert caught, f"rank {rank}, {key}: {name}: {msg}"


def test_fsspec_storage_is_dcpxs_even_where_torch_exports_its_own():
    """Older torch releases export FsspecWriter / FsspecReader at the top of
    torch.distributed.checkpoint: ``dcpx.FsspecWriter`` must still be dcpx's
    (CRCs, .metadata written last), never torch's taken by name."""
    import subprocess
    import sys
    code = (
        "import torch.distributed.checkpoint as t\n"
        "import sys; torch_took = 'fsspec' in sys.modules\n"
        "class W: pass\n"
        "class R: pass\n"
        "t.FsspecWriter, t.FsspecReader = W, R\n"
        "import dcpx, dcpx.fsspec\n"
        "assert dcpx.FsspecWriter is dcpx.fsspec.FsspecWriter, dcpx.FsspecWriter\n"
        "assert dcpx.FsspecReader is dcpx.fsspec.FsspecReader, dcpx.FsspecReader\n"
        "assert {'FsspecWriter', 'FsspecReader'} <= set(dcpx.__all__)\n"
        "print('fsspec' in sys.modules and not torch_took)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # importing dcpx does not import fsspec itself (it is optional; torch 2.8
    # imports it with torch.distributed.checkpoint when it is installed)
    assert out.stdout.strip() == "False", out.stdout
