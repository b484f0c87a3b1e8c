"""Argument parsing and dispatch.

Each component module exposes `register(subparsers)`; only registered commands
appear in `--help`, so the help text cannot advertise a command that does not exist.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Final

from gpudra.cli import logs
from gpudra.cli.terminal import printable

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# The commands, in `--help` order; each is registered by `gpudra.cli.<command>`.
COMMANDS: Final = ("node", "webhook", "migrate", "devices", "top", "report")


def _version() -> str:
    try:
        return version("gpudra")
    except PackageNotFoundError:
        return "0.0.0+dev"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command, or only `command` when it names one.

    A process imports what its parser registers, and keeps it: registering only the
    command it runs keeps the webhook's modules and cryptography out of every node
    agent's memory (and the node agent's out of the webhook's).
    """
    parser = argparse.ArgumentParser(
        prog="gpudra",
        description="Kubernetes DRA driver for NVIDIA GPUs and its admission webhook.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"gpudra {_version()}")
    _add_log_level(parser)
    # Flags are spelt out in full: manifests and checks of them (the chart's) match the
    # flags by name, which an abbreviation argparse would take gets past.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _registrations(command):
        register(sub)
    for command_parser in sub.choices.values():
        command_parser.allow_abbrev = False
    return parser


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` runs; None for the top-level help, no command or a malformed
    line, which the full parser then answers (with every command in its usage)."""
    early = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    _add_log_level(early)
    early.add_argument("-h", "--help", action="store_true")
    early.add_argument("command", nargs="?")
    early.add_argument("args", nargs=argparse.REMAINDER)  # the command's own, unparsed
    try:
        known, _ = early.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    if known.help or known.command not in COMMANDS:
        return None
    command: str = known.command
    return command


def _registrations(command: str | None) -> list[Registrar]:
    # Imported here so `gpudra --help` does not pay for every component's imports.
    names = (command,) if command in COMMANDS else COMMANDS
    return [importlib.import_module(f"gpudra.cli.{name}").register for name in names]


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    logs.setup(args.log_level)
    try:
        result: int = args.func(args)
    except SystemExit as e:
        # A command ends with one message, which may quote what the cluster or an
        # endpoint said: shown as text, never acted on by the terminal.
        if isinstance(e.code, str):
            raise SystemExit(printable(e.code, newlines=True)) from None
        raise
    return result


if __name__ == "__main__":
    sys.exit(main())
