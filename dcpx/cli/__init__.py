"""Command-line tools for checkpoints: ``dcpx`` (console script) and
``python -m dcpx``.

    dcpx ls ROOT            the checkpoints under ROOT (step-N folders and any
                            other checkpoint): step, size, committed, age
    dcpx inspect CKPT       what is in it: keys, dtypes, shapes, shards, files
    dcpx verify CKPT        read every record and check its CRC-32, one line
                            for each problem found
    dcpx diff A B           keys added or removed, dtype and shape changes;
                            --values: values too (--rtol/--atol)
    dcpx convert SRC DST    between DCP, torch.save and safetensors (single
                            file or sharded), streaming with bounded memory

One module per command (dcpx/cli/<command>.py: add_parser, run), sharing one
reader (dcpx/cli/_common.py).  Metadata is read with dcpx's safe unpickler:
looking at an untrusted checkpoint never runs code from it.  Progress bars
(tqdm, when installed) go to stderr, only when it is a terminal.

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
import pickle
import sys
from typing import Optional, Sequence

from ..errors import CheckpointError, IncompleteCheckpointError
from . import convert, diff, inspect, ls, verify
from ._common import CliError, NoCheckpoint

COMMANDS = (ls, inspect, verify, diff, convert)


def build_parser() -> argparse.ArgumentParser:
    exit_status = __doc__.split("\n\n")[-1].strip()
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dcpx", description=__doc__.split("\n\n")[0] + "\n\n"
                                + __doc__.split("\n\n")[1], epilog=exit_status,
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    for mod in COMMANDS:
        mod.add_parser(sub, epilog=exit_status, formatter_class=fmt)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: exit status 2 (argparse)
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
