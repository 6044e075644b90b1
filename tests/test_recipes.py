"""The recipes of docs/recipes.md, run.

* torchtitan: with torchtitan importable, its real ``CheckpointManager`` (``async_mode`` "disabled" and
  "async") saves and resumes through dcpx after the one-line switch the recipe shows; without it, a script
  that makes torchtitan's exact ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls (keyword for keyword,
  including the ``AsyncCheckpointerType.PROCESS`` + ``async_stager`` call of its pinned-memory mode) runs.
* Lightning Fabric: with lightning importable, ``ModelParallelStrategy`` (FSDP2) on 2 CPU ranks saves and
  loads a sharded checkpoint through dcpx.
* safetensors export: ``python -m dcpx convert CKPT OUT --to safetensors`` and ``safetensors.torch.load_file``
  (skipped until the CLI has ``convert`` and where safetensors is missing).

Every script counts calls to dcpx's functions, so a test passes only if dcpx, not torch, did the I/O.
The scripts run in subprocesses: they initialise process groups and replace torch's module attributes.
"""
from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "docs", "recipes.md")

# The switch docs/recipes.md tells torchtitan and Lightning users to make; the scripts below run exactly it.
SWITCH = "dcp.save, dcp.async_save, dcp.load = dcpx.save, dcpx.async_save, dcpx.load"

PRELUDE = f'''
import os, sys, torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import dcpx
{SWITCH}
# spies around dcpx's functions, installed after the recipe's switch: count what reached dcpx
CALLS = []
def _spy(name, fn):
    def f(*a, **k):
        CALLS.append((name, tuple(sorted(k))))
        return fn(*a, **k)
    return f
dcp.save, dcp.async_save, dcp.load = _spy("save", dcp.save), _spy("async_save", dcp.async_save), _spy("load", dcp.load)
assert dcpx.save is not torch.distributed.checkpoint.state_dict_saver.save
'''


def _run(tmp_path, body, *args, timeout=240):
    script = tmp_path / "recipe_script.py"
    # under a __main__ guard, as a training script must be where a save starts a process with `spawn`
    # (AsyncCheckpointerType.PROCESS): the child imports the script again
    body = "def main():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    script.write_text(PRELUDE + body + "\n\nif __name__ == '__main__':\n    main()\n")
    env = dict(os.environ)
    # the child sees what this interpreter sees (dcpx from this tree, optional packages from PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in sys.path if p])
    r = subprocess.run([sys.executable, str(script)] + [str(a) for a in args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}"
    return r.stdout


def test_recipes_doc_shows_the_switch_the_tests_run():
    with open(RECIPES) as f:
        text = f.read()
    assert SWITCH in text
    assert "python -m dcpx convert ckpt/step-1000 hf/" in text and "--strip-prefix model." in text
    assert "docs/manager.md" in text or "manager.md" in text


# --------------------------------------------------------------------------------------------- torchtitan

TORCHTITAN = '''
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.dcp import CheckpointManager

mode, root = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "store"), rank=0, world_size=1)
OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

class Optimizers(Stateful):  # what torchtitan's OptimizersContainer returns: a flat FQN-keyed dict
    def __init__(self, model, opt): self.model, self.opt = model, opt
    def state_dict(self): return get_optimizer_state_dict(self.model, self.opt, options=OPTS)
    def load_state_dict(self, sd): set_optimizer_state_dict(self.model, self.opt, sd, options=OPTS)

class Counter(Stateful):
    def __init__(self): self.step = 0
    def state_dict(self): return {"step": torch.tensor(self.step)}
    def load_state_dict(self, sd): self.step = int(sd["step"])

def build(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), Counter()

def manager(m, o, ts):
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=2, async_mode=mode,
                                   keep_latest_k=0, last_save_model_only=False)
    return CheckpointManager(cfg, dataloader=None, model_parts=[m], optimizers=Optimizers(m, o),
                             lr_schedulers=Counter(), states={"train_state": ts}, sd_adapter=None,
                             base_folder=root)

m, o, ts = build(0)
cm = manager(m, o, ts)
for step in range(1, 5):
    m(torch.randn(3, 8)).sum().backward(); o.step(); o.zero_grad(); ts.step = step
    cm.save(curr_step=step)
    if step == 2:
        cm.maybe_wait_for_saving()
        ref_m = {k: v.clone() for k, v in m.state_dict().items()}
        ref_o = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in Optimizers(m, o).state_dict().items()}
cm.maybe_wait_for_saving()
cm.close()
steps = sorted(os.listdir(os.path.join(root, "checkpoint")))
assert steps == ["step-2", "step-4"], steps

m2, o2, ts2 = build(1)
m2(torch.randn(3, 8)).sum().backward(); o2.step(); o2.zero_grad()
cm2 = manager(m2, o2, ts2)
assert cm2.load(step=2)
cm2.close()
for k, v in ref_m.items():
    assert torch.equal(m2.state_dict()[k], v), k
got = Optimizers(m2, o2).state_dict()
for k, v in ref_o.items():
    assert (torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v), k
assert ts2.step == 2, ts2.step
# torch's own loader reads what torchtitan wrote through dcpx (same format)
probe = {k: torch.zeros_like(v) for k, v in ref_m.items()}
torch.distributed.checkpoint.state_dict_loader.load(probe, checkpoint_id=os.path.join(root, "checkpoint", "step-4"))
dist.destroy_process_group()
print("CALLS", CALLS)
'''


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_torchtitan_checkpointer_through_dcpx(tmp_path, mode):
    pytest.importorskip("torchtitan.components.checkpointer.dcp")
    out = _run(tmp_path, TORCHTITAN, mode, tmp_path)
    calls = ast.literal_eval(out.split("CALLS", 1)[1].strip())
    save = "save" if mode == "disabled" else "async_save"
    want = ("checkpoint_id", "storage_writer") + (("process_group",) if mode == "async" else ())
    assert calls == [(save, tuple(sorted(want)))] * 2 + [("load", ("checkpoint_id",))]


TORCHTITAN_CALLS = '''
from concurrent.futures import Future
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

root = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "store"), rank=0, world_size=1)
pg = dist.new_group(backend="gloo")  # torchtitan: self.pg for its async modes

class ModelWrapper(Stateful):  # torchtitan's: the model's state flattened into the top level
    def __init__(self, model): self.model = [model]
    def state_dict(self): return {k: v for m in self.model for k, v in m.state_dict().items()}
    def load_state_dict(self, sd):
        for m in self.model: m.load_state_dict(sd, strict=False)

class OptimizerWrapper(Stateful):
    def __init__(self, opt): self.opt = opt
    def state_dict(self):
        if not self.opt.state:  # torchtitan's init_optim_state: a zero-gradient step creates the state to load into
            for g in self.opt.param_groups:
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return self.opt.state_dict()
    def load_state_dict(self, sd): self.opt.load_state_dict(sd)

torch.manual_seed(0)
model = nn.Linear(16, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(2, 16)).sum().backward(); opt.step()
states = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(opt), "train_state": {"step": 7}}

def flattened():  # torchtitan's _flattened_model_states_sd
    sd = {k: v for k, v in states.items() if k != "model"}
    sd.update(states["model"].state_dict())
    return sd

ref = {k: v.clone() for k, v in model.state_dict().items()}
storage_writer = None
# AsyncMode.DISABLED
dcp.save(flattened(), storage_writer=storage_writer, checkpoint_id=os.path.join(root, "step-1"))
# AsyncMode.ASYNC
f = dcp.async_save(flattened(), storage_writer=storage_writer, checkpoint_id=os.path.join(root, "step-2"),
                   process_group=pg)
assert isinstance(f, Future); f.result()
# AsyncMode.ASYNC_WITH_PINNED_MEM: torchtitan's stager pins and copies non-blocking, which needs an
# accelerator; on CPU the same call with a CPU-valid torch DefaultStager.
stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                      use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))
r = dcp.async_save(flattened(), storage_writer=storage_writer, checkpoint_id=os.path.join(root, "step-3"),
                   process_group=pg, async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
assert isinstance(r, AsyncSaveResponse)
r.staging_completion.result(); r.upload_completion.result()
stager.close()

for step in (1, 2, 3):
    with torch.no_grad():
        for p in model.parameters(): p.zero_()
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(opt2), "train_state": {"step": 0}}
    sd = flattened()
    dcp.load(sd, checkpoint_id=os.path.join(root, f"step-{step}"))
    states["model"].load_state_dict(sd)  # torchtitan: self.states[MODEL].load_state_dict(state_dict)
    for k, v in ref.items():
        assert torch.equal(model.state_dict()[k], v), (step, k)
    assert sd["train_state"]["step"] == 7, sd["train_state"]
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"]), step
dist.destroy_process_group()
print("CALLS", CALLS)
'''


def test_torchtitan_calls_mimicked(tmp_path):
    """torchtitan's three dcp calls, keyword for keyword, without torchtitan installed."""
    out = _run(tmp_path, TORCHTITAN_CALLS, tmp_path)
    calls = ast.literal_eval(out.split("CALLS", 1)[1].strip())
    assert [c[0] for c in calls] == ["save", "async_save", "async_save", "load", "load", "load"]
    assert calls[2][1] == ("async_checkpointer_type", "async_stager", "checkpoint_id", "process_group",
                           "storage_writer")


# --------------------------------------------------------------------------------------- Lightning Fabric

FABRIC = '''
import json
import lightning as L
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

def parallelize(model, device_mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model

root = sys.argv[1]
fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize_fn=parallelize))
fabric.launch()

def build(seed):
    torch.manual_seed(seed)
    with fabric.init_module(empty_init=False):
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m = fabric.setup(m)
    return m, fabric.setup_optimizers(torch.optim.AdamW(m.parameters(), lr=1e-2))

m, o = build(0)
for _ in range(3):
    fabric.backward(m(torch.randn(3, 8)).sum()); o.step(); o.zero_grad()
path = os.path.join(root, "ckpt")
fabric.save(path, {"model": m, "optimizer": o, "step": 3})
ref_m = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
ref_o = [s["exp_avg"].full_tensor().clone() for s in o.state_dict()["state"].values()]

m2, o2 = build(1)
state = {"model": m2, "optimizer": o2, "step": 0}
fabric.load(path, state)
for k, v in ref_m.items():
    assert torch.equal(m2.state_dict()[k].full_tensor(), v), k
got_o = [s["exp_avg"].full_tensor() for s in o2.state_dict()["state"].values()]
assert len(got_o) == len(ref_o) and all(torch.equal(a, b) for a, b in zip(got_o, ref_o))
assert state["step"] == 3
assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
with open(os.path.join(root, f"calls{fabric.global_rank}.json"), "w") as f:  # ranks share stdout
    json.dump([c[0] for c in CALLS], f)
'''


def test_lightning_fabric_model_parallel_through_dcpx(tmp_path):
    pytest.importorskip("lightning.fabric")
    _run(tmp_path, FABRIC, tmp_path)
    for rank in (0, 1):
        with open(tmp_path / f"calls{rank}.json") as f:
            calls = json.load(f)
        assert calls[0] == "save" and calls.count("save") == 1 and "load" in calls, calls


# ------------------------------------------------------------------------------------ safetensors export

def _has_convert():
    r = subprocess.run([sys.executable, "-m", "dcpx", "convert", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path)), timeout=120)
    return r.returncode == 0 and "safetensors" in r.stdout


def _convert(*args):
    r = subprocess.run([sys.executable, "-m", "dcpx", "convert", *map(str, args)], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path)))
    assert r.returncode == 0, r.stderr


def test_export_to_safetensors(tmp_path):
    """docs/recipes.md's two commands: the model's weights of a training checkpoint, one file and Hub-style
    shards with model.safetensors.index.json."""
    st = pytest.importorskip("safetensors.torch")
    if not _has_convert():
        pytest.skip("this tree's CLI has no `convert --to safetensors` yet (docs/cli.md)")
    import dcpx
    g = torch.Generator().manual_seed(3)
    model = {"embed.weight": torch.randn(32, 8, generator=g), "layers.0.bias": torch.randn(8, generator=g),
             "head.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16)}
    ckpt = tmp_path / "ckpt" / "step-1000"
    dcpx.save({"model": model, "optimizer": {"state": {"m": torch.ones(3)}}, "step": 1000}, checkpoint_id=str(ckpt))

    def check(got):
        assert sorted(got) == sorted(model)
        for k, v in model.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    (tmp_path / "hf").mkdir()
    _convert(ckpt, tmp_path / "hf" / "model.safetensors", "--only", "model.", "--strip-prefix", "model.")
    check(st.load_file(str(tmp_path / "hf" / "model.safetensors")))

    _convert(ckpt, tmp_path / "hf-sharded", "--max-shard-size", "1KB", "--only", "model.", "--strip-prefix", "model.")
    with open(tmp_path / "hf-sharded" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert sorted(index["weight_map"]) == sorted(model)
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(st.load_file(str(tmp_path / "hf-sharded" / name)))
    assert len(set(index["weight_map"].values())) > 1
    check(got)
