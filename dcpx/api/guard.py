"""The checkpoint process and scripts without ``if __name__ == "__main__":``.

``AsyncCheckpointerType.PROCESS`` (``CheckpointManager(async_mode="process")``)
starts its checkpoint process with multiprocessing's ``spawn`` method, which
imports the main script again in the new process (as ``__mp_main__``).  A
script whose training code is not under ``if __name__ == "__main__":`` then
runs again there: it saved into the same folders and started another
checkpoint process, and the parent only saw ``Connection reset by peer``.
Python's multiprocessing documentation ("Safe importing of main module") and
torch.multiprocessing require that guard with ``spawn``.

Two checks say so instead (docs/api.md, "The checkpoint process"):

* in the parent, before the process is started: the ``async_save`` call is
  found in the main script's module-level code outside any ``if`` block
  (``check_main_guarded``): a RuntimeError naming the line, and nothing runs;
* in the child, the safety net: a dcpx call made while the child is still
  importing the main script (``check_not_bootstrapping``) writes the reason
  to stderr and ends the child with ``EXIT_CODE``; the parent's error then
  says the same (``guard_error``).
"""
from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from typing import Optional

CHILD_NAME = "dcpx-checkpoint-process"
EXIT_CODE = 93

#: this process is dcpx's checkpoint process (spawn sets the name before it
#: imports the main script again, so this is known at dcpx's import)
_IN_CHILD = multiprocessing.current_process().name == CHILD_NAME
#: set by the checkpoint process's main loop: from then on dcpx calls are its own
worker_running = False

_RULE = ("Put the script's training code under `if __name__ == \"__main__\":` (the rule of "
         "Python's multiprocessing with the 'spawn' start method, \"Safe importing of main "
         "module\", which torch.multiprocessing follows), or use the THREAD checkpointer "
         "(async_mode=\"async\").")


def _main_path() -> Optional[str]:
    """The main script spawn imports again in a child, or None (no file, or
    ``python -m pkg`` whose ``__main__`` spawn does not run again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None) or ""
    if not path or name == "__main__" or name.endswith(".__main__"):
        return None
    return path


def message(what: str) -> str:
    return (f"dcpx: {what}: the checkpoint process (async_save with "
            f"AsyncCheckpointerType.PROCESS, CheckpointManager(async_mode=\"process\")) is "
            f"started with multiprocessing's 'spawn' method, which imports the main script "
            f"again in that process, so the script's code runs there again (saving into the "
            f"same folders). {_RULE}")


def check_not_bootstrapping(what: str) -> None:
    """In the checkpoint process: a dcpx call before its main loop started
    comes from the main script run again by spawn; stop the child at once
    (before the call touches anything), saying why."""
    if not _IN_CHILD or worker_running:
        return
    f, where = sys._getframe(1), "?"
    while f is not None:
        if f.f_globals.get("__name__") == "__mp_main__":
            where = f"{f.f_code.co_filename}:{f.f_lineno}"
            break
        f = f.f_back
    try:
        sys.stderr.write(message(f"dcpx.{what} was called at {where}, in the main script "
                                 f"run again in the checkpoint process; stopping that process")
                         + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)


def guard_error(exitcode: Optional[int]) -> Optional[RuntimeError]:
    """The parent's error for a checkpoint process that ended with EXIT_CODE."""
    if exitcode != EXIT_CODE:
        return None
    path = _main_path() or "the main script"
    return RuntimeError(message(f"the checkpoint process stopped (exit code {EXIT_CODE}): the "
                                f"main script {path} ran again in it and reached a dcpx call "
                                f"outside `if __name__ == \"__main__\":` (the line is on "
                                f"stderr)"))


def _inside_if(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` of the module lies inside any ``if`` block (a
    ``__name__`` guard, or a guard of the user's own: not second-guessed)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and node.lineno <= line
                and line <= (getattr(node, "end_lineno", None) or line)):
            return True
    return False


def check_main_guarded(what: str = "async_save(async_checkpointer_type=PROCESS) was called") -> None:
    """In the parent, before the checkpoint process starts: raise a
    RuntimeError if this call comes from the main script's module-level
    code outside any ``if`` block (so spawn would run it again)."""
    if _IN_CHILD:
        return
    path = _main_path()
    if path is None:
        return
    main_globals = sys.modules["__main__"].__dict__
    f = sys._getframe(1)
    while f is not None and not (f.f_globals is main_globals and f.f_code.co_name == "<module>"):
        f = f.f_back
    if f is None:  # called from a function the script's own code did not call at top level
        return
    line = f.f_lineno
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return
    if _inside_if(tree, line):
        return
    raise RuntimeError(message(f"{what} at {path}:{line}, in the main script's module-level "
                               f"code outside `if __name__ == \"__main__\":`"))
