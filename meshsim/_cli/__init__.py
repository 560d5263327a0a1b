"""The ``meshsim`` command: ``meshsim run`` (torchrun's command on simulated ranks) and ``meshsim demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``meshsim`` command with ``argv`` (default: the process's); returns the exit status."""
    from meshsim._cli import demo, run

    parser = argparse.ArgumentParser(
        prog="meshsim", description="Run distributed PyTorch code on N simulated ranks."
    )
    sub = parser.add_subparsers(dest="name", required=True, metavar="{run,demo}")
    run.add_parser(sub)
    demo.add_parser(sub)
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(run.bare_ledger(given) if given[:1] == ["run"] else given)
    status: int = args.command(args)
    return status
