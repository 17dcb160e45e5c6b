"""The engram-stream console script (pyproject.toml [project.scripts]): engram_stream.cli.main.

It stands outside the package because `import engram_stream` refuses an ENGRAM_STREAM_ISA this
CPU does not run (engram_stream.engine.isa) before any module of the package can catch it: here
that refusal becomes the command's one-line usage error (exit status 2) for every command,
--version and --help included; --debug, anywhere on the line, shows the traceback instead.
"""
from __future__ import annotations

import sys

# engram_stream.errors.IsaEnvironmentError, by its name: the package that defines it is the
# import that failed
_REFUSAL = ("engram_stream.errors", "IsaEnvironmentError")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        from engram_stream import cli
    except RuntimeError as e:
        if (type(e).__module__, type(e).__qualname__) != _REFUSAL or "--debug" in args:
            raise
        print(f"engram-stream: error: {e}", file=sys.stderr)
        return 2
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
