"""The pieces the bench scripts share (not part of the package). A script imports from here, never
from another script; it chooses the engram_stream first (tools/checkout.py), then imports these,
which import it. A script's folder is first on sys.path, so `from _lib.timing import median`."""
