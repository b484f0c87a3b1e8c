"""Argument parsing and dispatch.

Each component module exposes `register(subparsers)`; only registered commands
appear in `--help`, so the help text cannot advertise a command that does not exist.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from gpudra.cli import logs

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _version() -> str:
    try:
        return version("gpudra")
    except PackageNotFoundError:
        return "0.0.0+dev"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudra",
        description="Kubernetes DRA driver for NVIDIA GPUs and its admission webhook.",
    )
    parser.add_argument("--version", action="version", version=f"gpudra {_version()}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _registrations():
        register(sub)
    return parser


def _registrations() -> list[Registrar]:
    # Imported here so `gpudra --help` does not pay for every component's imports.
    from gpudra.cli import devices, migrate, node, report, top, webhook  # noqa: PLC0415

    return [
        node.register,
        webhook.register,
        migrate.register,
        devices.register,
        top.register,
        report.register,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
