"""The `jckpt` command: inspect, verify, diff, convert and merge checkpoints.

```text
jckpt inspect model.jckpt             # entries, sizes, offsets, metadata
jckpt inspect model.jckpt --json      # the same, for scripts
jckpt verify model.jckpt              # layout and every checksum; exit 1 if damaged
jckpt diff a.jckpt b.jckpt --atol 1e-6
jckpt convert old.jckpt new.jckpt --alignment 4096
jckpt convert model.safetensors model.jckpt
jckpt merge both.jckpt teacher.jckpt student.jckpt --prefix teacher --prefix student
```

Exit status: 0 when the command succeeded (and, for `verify` and
`diff`, the file is sound / the checkpoints match), 1 when `verify`
found damage or `diff` found differences, 2 for a usage error, a file
that cannot be read, or a URL no storage backend serves (`s3://`, `gs://`,
`az://` are served; see docs/object-storage.md). An error prints one line
naming the file and what to do; `--debug` shows the traceback too.

`inspect`, `verify` and `diff` read headers and payloads with the
codec alone and never import JAX, so they start in a fraction of a second.
The library itself prints nothing: this module configures the `jckpt`
logger to write to stderr (`-v` for more).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from jckpt.adapters import convert, format_for_destination, refuse_replacing_other_files
from jckpt.api.progress import bar
from jckpt.errors import CheckpointError, FormatError, InputError
from jckpt.format import strict_json
from jckpt.format.limits import check_alignment
from jckpt.storage.backend import backend_for, occupied, same_place
from jckpt.tools.classify import (
    CUT_SHORT,
    DIRECTORY,
    FILE,
    FORMAT_STEP,
    MISSING,
    UNFINISHED,
    UNKNOWN,
    UNREADABLE,
    classify,
)
from jckpt.tools.consolidate import consolidate
from jckpt.tools.diff import diff
from jckpt.tools.info import info
from jckpt.tools.render import plural, printable
from jckpt.tools.rewrite import merge, relayout
from jckpt.tools.verify import verify_classified
from jckpt.version import __version__

log = logging.getLogger('jckpt.cli')

EXIT_OK = 0
EXIT_DIFFERENT = 1  # verify found damage, diff found differences
EXIT_ERROR = 2      # usage error, or a file that could not be read
#: The reader of the output went away (`jckpt inspect big.jckpt | head -1`): 128 + SIGPIPE, as
#: a shell reports a command that SIGPIPE ended; neither success nor damage was established.
EXIT_READER_GONE = 141


def _print(text: str) -> None:
    sys.stdout.write(printable(text, keep='\n\t') + '\n')


def _print_json(value: Any) -> None:
    _print(strict_json.dumps(value, indent=2))


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress


# --- subcommands -------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    summary = info(args.path, best_metric=args.best_metric, best_mode=args.best_mode)
    if args.json:
        _print_json(summary.to_dict())
    else:
        _print(summary.render(width=None))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    kind = classify(args.path)
    if kind.error is not None and kind.detail not in (UNREADABLE, UNFINISHED, FORMAT_STEP,
                                                      CUT_SHORT):
        # no checkpoint there at all (missing, another format, an empty directory): say what it
        # is and exit 2, where verify() would report it as a damaged checkpoint
        raise kind.error
    start = time.perf_counter()
    report = verify_classified(kind, progress=_progress(args))  # classified once, read once
    log.info("verified %s in %.3f s", args.path, time.perf_counter() - start)
    if args.json:
        _print_json(report.to_dict(strict=args.strict))
    else:
        _print(report.render(strict=args.strict))
    failed = not report.ok or (args.strict and report.warnings)
    return EXIT_DIFFERENT if failed else EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, progress=_progress(args),
                  verify=not args.no_verify)
    if args.json:
        _print_json(report.to_dict())
    else:
        _print(report.render(show_all=args.all))
    return EXIT_OK if report.same else EXIT_DIFFERENT


def cmd_convert(args: argparse.Namespace) -> int:
    src, dst = args.src, args.dst
    for path in (src, dst):  # a URL no backend serves is refused before anything is read
        backend_for(path)
    kind = classify(src)
    if kind.name == MISSING:
        raise FormatError("no such file or directory", file=src, fix="check the source path")
    if kind.name == UNKNOWN and kind.detail != FORMAT_STEP and kind.error is not None:
        raise kind.error  # what inspect says of it, not detect_format's "pass format=", no flag
    same = same_place(src, dst)
    if not same:
        refuse_replacing_other_files(dst, "converting")
    if occupied(dst) and not (same or args.overwrite):
        raise InputError("converting would replace an existing checkpoint", file=dst,
                         fix="choose another destination, or pass --overwrite")
    if (args.format or format_for_destination(dst)) in (None, 'jckpt') and not args.namespace \
            and not args.nest:
        if kind.name == DIRECTORY:
            return _consolidate(args)
        if kind.name == FILE:
            return _relayout(args)
    if args.alignment is not None:
        raise InputError("--alignment applies only to jckpt destinations, and not with "
                         "--namespace", file=dst, fix="drop --alignment, or convert the "
                         "namespace first and rewrite that file with --alignment")
    if same:
        raise InputError("source and destination are the same file", file=dst,
                         fix="convert into another path")
    with bar(f"converting {os.path.basename(src)}", 0, enabled=_progress(args)):
        source, written = convert(src, dst, format=args.format, namespaces=args.namespace,
                                  nest=args.nest)
    _print(f"wrote {dst}: {written}, converted from {source}")
    return EXIT_OK


def _consolidate(args: argparse.Namespace) -> int:
    """`convert` of a multi-process directory into one jckpt file."""
    header = consolidate(args.src, args.dst, alignment=args.alignment,
                         verify=not args.no_verify, progress=_progress(args))
    _print(f"wrote {args.dst}: {plural(len(header.tensors), 'entry')} in one file, "
           f"alignment {header.alignment}")
    return EXIT_OK


def _relayout(args: argparse.Namespace) -> int:
    """`convert` of a jckpt file into another: payloads copied, laid out anew."""
    header = relayout(args.src, args.dst, alignment=args.alignment, overwrite=True,
                      verify=not args.no_verify, progress=_progress(args))
    _print(f"wrote {args.dst}: {plural(len(header.tensors), 'entry')}, "
           f"alignment {header.alignment}")
    return EXIT_OK


def cmd_merge(args: argparse.Namespace) -> int:
    prefixes = args.prefix or None
    if prefixes is not None and len(prefixes) != len(args.inputs):
        raise InputError(f"{len(prefixes)} --prefix options for {len(args.inputs)} inputs",
                         fix="give one --prefix per input, in the same order "
                             "(--prefix '' leaves an input's namespaces alone)")
    header = merge(args.out, args.inputs, prefixes, alignment=args.alignment,
                   append=args.append, overwrite=args.overwrite, verify=not args.no_verify,
                   progress=_progress(args))
    namespaces = sorted({e.namespace for e in header.tensors})
    _print(f"wrote {args.out}: {plural(len(header.tensors), 'entry')} in namespaces "
           f"{', '.join(namespaces) or '(none)'}")
    return EXIT_OK


# --- argument parsing ----------------------------------------------------------

def _nonnegative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _alignment(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    try:
        return check_alignment(value)
    except InputError as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _output(text: str) -> str:
    """An output path, refusing `-`: a checkpoint is written under a temporary name beside its
    path and renamed into place, and read back mapped, so it cannot go to standard output (a
    file named `-` was written instead, where a pipe was meant).

    >>> _output('-')
    Traceback (most recent call last):
    argparse.ArgumentTypeError: '-' (standard output) is not a path a checkpoint can be written to: ...
    """
    if text == '-':
        raise argparse.ArgumentTypeError(
            "'-' (standard output) is not a path a checkpoint can be written to: it is "
            "written beside its path under a temporary name, then renamed into place; name "
            "a file (./- for a file named '-')")
    return text


def _common(defaults: bool) -> argparse.ArgumentParser:
    """Options accepted both before and after the subcommand."""
    p = argparse.ArgumentParser(add_help=False)
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument('--debug', action='store_true', default=d(False),
                   help='show tracebacks and debug logging')
    p.add_argument('-v', '--verbose', action='store_true', default=d(False),
                   help='log what is being done (to stderr)')
    p.add_argument('--no-progress', action='store_true', default=d(False),
                   help='never draw progress bars (they appear only on a terminal anyway)')
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `jckpt` argument parser."""
    common = _common(defaults=False)
    parser = argparse.ArgumentParser(
        prog='jckpt', parents=[_common(defaults=True)],
        description='Look into, check, compare, convert and combine jckpt checkpoints.',
        epilog='Exit status: 0 success / sound / same, 1 damaged / different, 2 error.')
    parser.add_argument('--version', action='version', version=f'jckpt {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND', required=True)
    for add in (_add_inspect, _add_verify, _add_diff, _add_convert, _add_merge):
        add(sub, common)
    return parser


#: What `inspect`, `diff` and `convert` read besides jckpt's own checkpoints.
_FOREIGN = ("a file or directory in another format (safetensors, .pt, npz, npy, llm.c, "
            "orbax)")


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `inspect` subcommand to `sub` (`common`: the options every one takes)."""
    p = sub.add_parser('inspect', parents=[common], help='list what a checkpoint holds',
                       description='A table of namespaces, paths, dtypes, shapes, sizes, '
                                   'offsets and whether each payload can be memory-mapped; '
                                   'totals; and the file\'s metadata. For a checkpoint '
                                   'manager\'s directory, a table of its steps; for another '
                                   'format, its arrays as convert reads them.')
    p.add_argument('path', help=f"a checkpoint file, a multi-process checkpoint directory, a "
                               f"checkpoint manager's directory, or {_FOREIGN}")
    p.add_argument('--json', action='store_true', help='print JSON instead of a table')
    p.add_argument('--best-metric', metavar='NAME', default=None,
                   help='manager directories: the metric that picks the best step '
                        '(default: loss, if recorded)')
    p.add_argument('--best-mode', choices=('min', 'max'), default='min',
                   help='manager directories: whether the best step has the lowest or the '
                        'highest metric (default min)')
    p.set_defaults(func=cmd_inspect)


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `verify` subcommand to `sub` (`common`: the options every one takes)."""
    p = sub.add_parser('verify', parents=[common], help='check layout and every checksum',
                       description='Check the layout and recompute every payload checksum. '
                                   'Exit status 0 only if all hold; each bad entry is named.')
    p.add_argument('path', help="a checkpoint file, a multi-process checkpoint directory or a "
                               "checkpoint manager's directory")
    p.add_argument('--json', action='store_true', help='print JSON instead of text')
    p.add_argument('--strict', action='store_true',
                   help='also fail on warnings (unchecked payloads, non-canonical layout)')
    p.set_defaults(func=cmd_verify)


def _add_diff(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `diff` subcommand to `sub` (`common`: the options every one takes)."""
    p = sub.add_parser('diff', parents=[common], help='compare two checkpoints',
                       description='Entries only in A, only in B, and for shared entries '
                                   'dtype/shape changes and the largest absolute and relative '
                                   'differences. Exit status 0 when they match.')
    p.add_argument('a', help=f'first checkpoint: a jckpt file or multi-process directory, or '
                             f'{_FOREIGN}')
    p.add_argument('b', help='second checkpoint, the same kinds (relative differences are taken '
                             'to it)')
    p.add_argument('--atol', type=_nonnegative, default=0.0,
                   help='absolute tolerance (default 0: exact)')
    p.add_argument('--rtol', type=_nonnegative, default=0.0,
                   help='relative tolerance: values match when |a-b| <= atol + rtol*|b| '
                        '(default 0)')
    p.add_argument('--all', action='store_true', help='also list the entries that match')
    p.add_argument('--json', action='store_true', help='print JSON instead of text')
    p.add_argument('--no-verify', action='store_true',
                   help='compare payloads without checking their checksums (a damaged one is '
                        'an error otherwise)')
    p.set_defaults(func=cmd_diff)


def _add_convert(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `convert` subcommand to `sub` (`common`: the options every one takes)."""
    p = sub.add_parser('convert', parents=[common], help='convert or rewrite a checkpoint',
                       description='Convert SRC (any format jckpt reads, detected from its '
                                   'content) into DST. jckpt to jckpt copies payloads verbatim '
                                   'with a new layout (--alignment) and keeps the metadata; a '
                                   'multi-process directory becomes one file. An existing DST '
                                   'other than SRC is kept unless --overwrite.')
    p.add_argument('src', help='the source checkpoint (file or directory)')
    p.add_argument('dst', type=_output, help='what to write (a path: not - for standard output)')
    p.add_argument('--format', metavar='NAME', default=None,
                   help="the destination's format, e.g. jckpt, safetensors, npz (default: from "
                        "DST's extension, else jckpt)")
    p.add_argument('--alignment', type=_alignment, default=None,
                   help="jckpt destinations: payload alignment in bytes (default: the source's)")
    p.add_argument('--overwrite', action='store_true', help='replace an existing DST')
    p.add_argument('--no-verify', action='store_true',
                   help='copy payloads without checking their checksums first')
    p.add_argument('--namespace', metavar='NS', action='append', default=None,
                   help='convert only this namespace (repeat for several), e.g. the parameters '
                        'of a training checkpoint; its payloads are always checked')
    p.add_argument('--nest', action='store_true',
                   help="split dotted names into nested dicts: a torch or safetensors "
                        "state_dict's 'dense.kernel' becomes dense/kernel")
    p.set_defaults(func=cmd_convert)


def _add_merge(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `merge` subcommand to `sub` (`common`: the options every one takes)."""
    p = sub.add_parser('merge', parents=[common], help='combine checkpoints into one file',
                       description='Model surgery: write OUT holding the entries of every IN, '
                                   'payloads copied verbatim. --prefix NAME (once per input, in '
                                   'order) renames that input\'s namespaces NS to NAME__NS.')
    p.add_argument('out', type=_output, help='the file to write (a path: not - for standard output)')
    p.add_argument('inputs', nargs='+', metavar='IN', help='checkpoint files to combine')
    p.add_argument('--prefix', action='append', metavar='NAME',
                   help="namespace prefix for the next input ('' for none); one per input")
    p.add_argument('--alignment', type=_alignment, default=None,
                   help='payload alignment in bytes (default 32)')
    p.add_argument('--append', action='store_true', help="keep OUT's existing entries")
    p.add_argument('--overwrite', action='store_true', help='replace an existing OUT')
    p.add_argument('--no-verify', action='store_true',
                   help='copy payloads without checking their checksums first')
    p.set_defaults(func=cmd_merge)


_handler: logging.Handler | None = None


def _configure_logging(args: argparse.Namespace) -> None:
    global _handler
    logger = logging.getLogger('jckpt')
    if _handler is not None:  # main() called again in this process: replace ours
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter('jckpt: %(levelname)s: %(message)s'))
    logger.addHandler(_handler)
    logger.setLevel(logging.DEBUG if args.debug else logging.INFO if args.verbose
                    else logging.WARNING)


def _error(message: str) -> None:
    sys.stderr.write(f"jckpt: error: {printable(message)}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `jckpt` command line; return its exit status.

    Example:
        ```text
        python -m jckpt verify model.jckpt && echo sound
        ```
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The subcommand's exit status; an error is one line (`--debug`: after its traceback),
    and exits `EXIT_ERROR` either way; output whose reader went away, `EXIT_READER_GONE`, with
    nothing on stderr."""
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader gone shows here, not at exit ("Exception ignored", 120)
        return status
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)  # what is left in stdout's buffer goes there
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_READER_GONE
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        _error(_message(e))
        return EXIT_ERROR


def _message(e: Exception) -> str:
    """The one line that says what went wrong."""
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}"
    return (f"unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback, "
            "and please report it)")


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """A warning as one line, as errors are (Python's form names a line of jckpt's source);
    another library's names its kind (`DeprecationWarning: ...`)."""
    kind = '' if issubclass(category, UserWarning) else f"{category.__name__}: "
    sys.stderr.write(f"jckpt: warning: {kind}{printable(str(message))}\n")
    sys.stderr.flush()


__all__ = ['build_parser', 'main']
