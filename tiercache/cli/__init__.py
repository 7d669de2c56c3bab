"""The ``tiercache`` command line: the parser, built from one module per command (each registers its flags
beside its handler), and `main`, which runs the chosen handler.

Every subcommand reports bad input as one line naming the flag or config field and exits with status 2; nothing
here prints a traceback for a user's mistake.
"""
from __future__ import annotations

import argparse
import os
import sys
import typing

from tiercache import __version__
from tiercache.cli import api, bench, cache, demo, generate, purge, route, serve, stats
from tiercache.config import naming_its_variable
from tiercache.errors import ConfigError, TierCacheError

COMMANDS = (bench, demo, generate, api, route, serve, cache, purge, stats)   # in `--help` order


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line — what is wrong and where the help is — not a usage dump (subcommands too: they
    are made with the parser's own class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiercache", description="Tiered KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:      # one found after the config loaded (building the stack) names its variable too
        print(f"tiercache: error: {naming_its_variable(err, os.environ, getattr(args, 'set', []))}", file=sys.stderr)
        return 2
    except TierCacheError as err:
        print(f"tiercache: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an unreadable input file
        print(f"tiercache: error: {err.filename or ''}: {err.strerror}", file=sys.stderr)
        return 2
    except ValueError as err:  # bad request input (empty prompt, too long, bad workload sizes, bad trace)
        print(f"tiercache: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
