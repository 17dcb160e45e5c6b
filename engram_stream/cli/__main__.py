"""python -m engram_stream.cli: the engram-stream command."""
import sys

from . import main

if __name__ == "__main__":   # imported (a check that imports every module), it runs nothing
    sys.exit(main())
