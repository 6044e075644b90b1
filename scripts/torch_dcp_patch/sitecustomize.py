"""Imported at the start of every Python process whose PYTHONPATH holds this
folder (scripts/torch_dcp_tests.sh puts it there for its "dcpx" runs): with
DCPX_PATCH_TORCH=1, torch.distributed.checkpoint's save / load / async_save
(and the deprecated save_state_dict / load_state_dict) become dcpx's, in
the package and in the modules that define them, before any test module
imports them, and in every process a test spawns.  dcpx itself calls
torch's originals, captured at its import (tests/test_monkeypatch.py)."""
import os

if os.environ.get("DCPX_PATCH_TORCH") == "1":
    import torch.distributed.checkpoint as _tdcp
    from torch.distributed.checkpoint import state_dict_loader as _loader
    from torch.distributed.checkpoint import state_dict_saver as _saver

    import dcpx as _dcpx

    for _mod in (_tdcp, _saver):
        _mod.save = _dcpx.save
        _mod.async_save = _dcpx.async_save
        _mod.save_state_dict = _dcpx.save_state_dict
    for _mod in (_tdcp, _loader):
        _mod.load = _dcpx.load
        _mod.load_state_dict = _dcpx.load_state_dict
    os.environ.setdefault("DCPX_PATCHED_TORCH_PID", str(os.getpid()))
