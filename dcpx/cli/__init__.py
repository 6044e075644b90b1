"""Command-line tools for checkpoints: ``dcpx`` (console script) and
``python -m dcpx``.

    dcpx ls ROOT            the checkpoints under ROOT (step-N folders and any
                            other checkpoint): step, size, committed, age
    dcpx inspect CKPT       what is in it: keys, dtypes, shapes, shards, files,
                            values (safely unpickled), damage
    dcpx verify CKPT        read every record and check its CRC-32, one line
                            for each problem found
    dcpx diff A B           keys added or removed, dtype and shape changes;
                            --values: values too (--rtol/--atol)
    dcpx convert SRC DST    between DCP, torch.save and safetensors (single
                            file or sharded), streaming with bounded memory

One module per command (dcpx/cli/<command>.py: HELP, add_parser, run),
sharing one reader (dcpx/cli/_common.py); a command's module is imported
only when that command runs, so --help and --version do not import torch.
Metadata is read with dcpx's safe unpickler: looking at an untrusted
checkpoint never runs code from it.  Progress bars (tqdm, when installed)
go to stderr, only when it is a terminal.

Exit status: 0 the checkpoint is sound (verify: every record read and
checked), no difference (diff), done (ls, inspect, convert);
1 the checkpoint has problems (verify reports every one, one line each,
naming the key and the file: a corrupt or unreadable .metadata, a missing,
truncated or unreadable data file, a CRC-32 mismatch, a value that does not
unpickle), the checkpoints differ (diff), the operation failed (convert: a
dtype the output format lacks, DST exists, a damaged input);
2 no checkpoint to check: a usage error, or the path does not exist, is not
a directory, or has no .metadata (never committed).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pickle
import sys
from typing import Optional, Sequence

#: the commands, in --help's order: dcpx/cli/<name>.py each
NAMES = ("ls", "inspect", "verify", "diff", "convert")


def _help_of(name: str) -> str:
    """The module's ``HELP`` string, read from its source without importing
    it (a command module may import torch, which takes seconds)."""
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "HELP"):
                return ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError, TypeError, AttributeError):
        pass
    return importlib.import_module(f"{__name__}.{name}").HELP


def build_parser(only: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The ``dcpx`` parser.  ``only``: the commands whose modules are
    imported for their full parsers (default: all); the others are listed
    by name and help line only, which is all ``dcpx --help`` shows."""
    from .. import version
    exit_status = __doc__.split("\n\n")[-1].strip()
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dcpx", description=__doc__.split("\n\n")[0] + "\n\n"
                                + __doc__.split("\n\n")[1], epilog=exit_status,
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"dcpx {version.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in NAMES:
        if only is None or name in only:
            mod = importlib.import_module(f"{__name__}.{name}")
            mod.add_parser(sub, epilog=exit_status, formatter_class=fmt)
        else:
            sub.add_parser(name, help=_help_of(name), add_help=False)
    return p


def _command(argv: Sequence[str]) -> Optional[str]:
    """The command named on the command line (the first argument that is
    not an option: the top level takes no option with a value)."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a if a in NAMES else None
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = _command(argv)
    # usage errors: exit status 2 (argparse); only the command given is
    # imported (with torch), so --help and --version answer at once
    args = build_parser(only=[cmd] if cmd else []).parse_args(argv)
    from ..errors import CheckpointError, IncompleteCheckpointError
    from ._common import CliError, NoCheckpoint
    try:
        return args.run(args)
    except (IncompleteCheckpointError, NotADirectoryError, FileNotFoundError, NoCheckpoint) as e:
        print(f"dcpx {args.cmd}: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, CliError, OSError, ValueError, TypeError) as e:
        print(f"dcpx {args.cmd}: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, pickle.UnpicklingError) as e:   # torch.load, safetensors, ...
        print(f"dcpx {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dcpx {args.cmd}: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    sys.exit(main())
