"""The engram-stream command: demo, inspect, init, build-compression, bench, tune, profile, publish,
pack-rows, each in its module here (its options and its run), dispatched by main.

Errors print one line (`engram-stream: error: ...`) and exit 1 (bad arguments: argparse's
usage line and exit 2; an ENGRAM_STREAM_ISA that `import engram_stream` refuses: one line and exit
2 too, from the console script, _engram_stream_launcher.py); --debug, anywhere on the line, shows
the traceback instead.
"""
from __future__ import annotations

import argparse
import signal
import sys

from .. import __version__
from . import bench, build_compression, demo, init, inspect, pack_rows, profile, publish, tune
from .common import CliError
from .sigterm import Terminated

# Each module's register(command) adds its subcommand and options (command(name, run, help, **kw)
# returns the subparser); run(args) is the command. In the order --help lists them:
COMMANDS = (demo, inspect, init, build_compression, bench, tune, profile, publish, pack_rows)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Epilogs keep their layout; every option shows its default (unless None/False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the subcommand too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    p = argparse.ArgumentParser(prog="engram-stream", description="Streaming inference engine for Engram.",
                                formatter_class=_Help)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func, help, **kw):
        s = sub.add_parser(name, help=help, description=help, parents=[debug], formatter_class=_Help, **kw)
        s.set_defaults(func=func)
        return s

    for module in COMMANDS:
        module.register(command)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram-stream: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("engram-stream: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:  # one clear line unless --debug
        if getattr(args, "debug", False):
            raise
        msg = str(e) if isinstance(e, (CliError, OSError, ValueError, TypeError, KeyError, ImportError)) \
            else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.filename:
            msg = f"{e.filename}: {e.strerror or e}"
        print(f"engram-stream: error: {msg}", file=sys.stderr)
        return 1


