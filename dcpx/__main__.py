"""``python -m dcpx``: the command-line tools of :mod:`dcpx.cli`.

``main``, ``verify_checkpoint`` and ``inspect_checkpoint`` stay importable
from here (tests and the crash harness use them)."""
import sys

from .cli import main
from .cli.inspect import inspect_checkpoint
from .cli.verify import verify_checkpoint

__all__ = ["main", "verify_checkpoint", "inspect_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())
