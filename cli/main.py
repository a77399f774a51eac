"""The ``zoo`` command: every subcommand of the project under one parser.

Each package that brings commands exposes ``add_commands(sub)``, which adds its subparsers to ``sub`` and returns
``{name: handler}``; this module sits above them all (``cli`` may import ``training`` and ``serving``, which import
neither each other nor ``cli``).

A mistake of the user's (a path that does not exist, a file that is not a checkpoint, a port in use, a bad option
value) ends the command with one line on stderr, ``zoo: error: WHAT; WHAT TO DO``, and exit status 1; ``--debug``
or the environment variable ``ZOO_DEBUG=1`` shows the traceback instead (``USER_ERRORS``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from serving import bench as bench_commands
from serving import cli as serving_commands

from . import evaluate, finetune, model_tools

COMMAND_GROUPS: tuple[Any, ...] = (serving_commands, finetune, evaluate, model_tools, bench_commands)

#: The exceptions that report a user's mistake (bad input, missing files, the network, a port in use): one line
#: without a traceback. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, LookupError, ImportError,
                                                NotImplementedError)


def version() -> str:
    """The installed ``transformer-zoo`` version.

    Returns:
        The version string (``0+unknown`` for a source checkout that is not installed).
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("transformer-zoo")
    except PackageNotFoundError:
        return "0+unknown"


def parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
    """Build the ``zoo`` parser.

    Returns:
        The parser and each command's handler by name.
    """
    p = argparse.ArgumentParser(prog="zoo", description=serving_commands.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"zoo (transformer-zoo) {version()}")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error (also: the environment variable ZOO_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[[argparse.Namespace], None]] = {}
    for group in COMMAND_GROUPS:
        handlers.update(group.add_commands(sub))
    return p, handlers


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (its lines joined), for ``zoo: error: ...``.

    Args:
        err: the exception.

    Returns:
        The message (a ``KeyError``'s key without quotes; the class name for an empty message).
    """
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = str(err.args[0])
    return text or type(err).__name__


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the command it names; a user's mistake exits with status 1
    and one line on stderr (``USER_ERRORS``; a command's own ``SystemExit("zoo: error: ...")`` is printed by Python
    alike), Ctrl-C with status 130.

    Args:
        argv: the command-line arguments (None: ``sys.argv[1:]``).

    Raises:
        SystemExit: status 1 after a user's mistake (with ``--debug`` or ``ZOO_DEBUG=1`` the error itself is
            raised), 130 after Ctrl-C.
    """
    p, handlers = parser()
    args = p.parse_args(argv)
    debug = args.debug or os.environ.get("ZOO_DEBUG", "") not in ("", "0")
    try:
        handlers[args.command](args)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write("\nzoo: interrupted\n")
        raise SystemExit(130) from None
    except USER_ERRORS as err:
        if debug:
            raise
        sys.stderr.write(f"zoo: error: {one_line(err)}\n")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
