"""async_save with the PROCESS checkpointer (CheckpointManager(async_mode=
"process")) from a script without ``if __name__ == "__main__":`` (issue 22,
item 4): spawn imports the main script again in the checkpoint process; the
parent reported 'Connection reset by peer' and the child ran the training
script again, saving into the same folders.  Now: a RuntimeError naming
the line and the rule, and the script is not run again."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)


HEAD = """\
    import sys, torch, dcpx
    print("script runs", file=sys.stderr, flush=True)
    root = sys.argv[1]
    sd = {"w": torch.ones(4)}
"""


def test_unguarded_top_level_async_save_refused_in_parent(tmp_path):
    r = _run(tmp_path, HEAD + """\
    dcpx.save(sd, checkpoint_id=root + "/a")
    f = dcpx.async_save(sd, checkpoint_id=root + "/b",
                        async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS)
    f.result()
    """)
    assert r.returncode == 1
    assert "RuntimeError: dcpx: async_save(async_checkpointer_type=PROCESS) was called at " in r.stderr
    assert "train.py:6, in the main script's module-level code outside `if __name__ == " in r.stderr
    assert "Connection reset" not in r.stderr
    assert r.stderr.count("script runs") == 1  # never run again in a child
    assert not (tmp_path / "out" / "b").exists()


def test_unguarded_manager_process_mode_refused(tmp_path):
    r = _run(tmp_path, HEAD + """\
    with dcpx.CheckpointManager(root, async_mode="process") as ckpt:
        for step in range(1, 3):
            ckpt.save(step, sd)
    """)
    assert r.returncode == 1
    assert "train.py:7, in the main script's module-level code" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("script runs") == 1
    assert not any((tmp_path / "out").glob("step-*/.metadata"))


def test_child_stops_script_run_again_from_a_thread(tmp_path):
    """The call is not in module-level code (a thread started by it): the
    parent cannot see it; the child stops at its first dcpx call and the
    parent says why instead of 'Connection reset by peer'."""
    r = _run(tmp_path, HEAD + """\
    import threading
    def main():
        dcpx.save(sd, checkpoint_id=root + "/a")
        dcpx.async_save(sd, checkpoint_id=root + "/b",
                        async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS).result()
    t = threading.Thread(target=main)
    t.start()
    t.join()
    """)
    assert "dcpx.save was called at " in r.stderr and "train.py:7" in r.stderr, r.stderr[-3000:]
    assert "stopping that process" in r.stderr
    assert "the checkpoint process stopped (exit code 93): the main script " in r.stderr
    assert r.stderr.count("script runs") == 2  # the child ran it, stopped at its first dcpx call
    assert not (tmp_path / "out" / "b" / ".metadata").exists()


def test_guarded_script_works(tmp_path):
    r = _run(tmp_path, HEAD + """\
    def main():
        with dcpx.CheckpointManager(root, async_mode="process") as ckpt:
            for step in range(1, 3):
                ckpt.save(step, sd)
        print("steps", dcpx.CheckpointManager(root).all_steps())
    if __name__ == "__main__":
        main()
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "steps [1, 2]" in r.stdout
    # the child imports the script again (its module-level print runs), not main()
    assert r.stderr.count("script runs") == 2


def test_call_inside_any_if_block_is_not_second_guessed(tmp_path):
    guard = "if len(sys.argv) > 1:"
    """A guard of the script's own (any ``if``) is left to it: only the
    child-side check applies there."""
    r = _run(tmp_path, HEAD + f"""\
    {guard}
        if __name__ == "__main__":
            dcpx.async_save(sd, checkpoint_id=root + "/b",
                            async_checkpointer_type=dcpx.AsyncCheckpointerType.PROCESS).result()
            print("saved")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "saved" in r.stdout
