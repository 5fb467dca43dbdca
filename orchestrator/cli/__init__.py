"""``meshpilot`` command line: one sub-command per module, user mistakes exit 2 without a traceback.

Runs on the driver (the user's terminal, or a Ray job's entrypoint). Each command module in
``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its parser and sets
``handler=`` to a function ``(args) -> int`` returning the exit code. A command module parses
and prints; the work is done by ``orchestrator.driver`` (train, demo), ``orchestrator.submission``
(submit, jobs), ``orchestrator.analysis`` (report, simulate), ``elastic`` (plan),
``checkpointing`` (ckpt) or ``orchestrator.data_prep`` (data). Nothing imports ``cli`` but the console script.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from orchestrator.errors import user_error_types
from orchestrator.observe.redact import redact_text

COMMAND_MODULES: tuple[str, ...] = (
    "orchestrator.cli.train",
    "orchestrator.cli.demo",
    "orchestrator.cli.plan",
    "orchestrator.cli.report",
    "orchestrator.cli.submit",
    "orchestrator.cli.ckpt",
    "orchestrator.cli.data",
)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line naming the flag, like every other user error."""

    def error(self, message: str) -> NoReturn:  # noqa: D401 - argparse hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="meshpilot", description="Elastic 3D-parallel training on Ray.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except user_error_types() as error:
        print(f"meshpilot: {redact_text(str(error))}", file=sys.stderr)
        return getattr(error, "exit_code", 2)
    except KeyboardInterrupt:
        print("meshpilot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
