"""The ``zoo`` command: every subcommand of the project under one parser.

Each package that brings commands exposes ``add_commands(sub)``, which adds its subparsers to ``sub`` and returns
``{name: handler}``; this module sits above them all (``cli`` may import ``training`` and ``serving``, which import
neither each other nor ``cli``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from serving import bench as bench_commands
from serving import cli as serving_commands

from . import evaluate, finetune, model_tools

COMMAND_GROUPS: tuple[Any, ...] = (serving_commands, finetune, evaluate, model_tools, bench_commands)


def parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], None]]]:
    """Build the ``zoo`` parser.

    Returns:
        The parser and each command's handler by name.
    """
    p = argparse.ArgumentParser(prog="zoo", description=serving_commands.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[[argparse.Namespace], None]] = {}
    for group in COMMAND_GROUPS:
        handlers.update(group.add_commands(sub))
    return p, handlers


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the command it names."""
    p, handlers = parser()
    args = p.parse_args(argv)
    handlers[args.command](args)


if __name__ == "__main__":
    main()
