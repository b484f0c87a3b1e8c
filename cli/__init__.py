"""The `gpudra` command line: one entry point, one subcommand per component."""

from gpudra.cli.main import main

__all__ = ["main"]
