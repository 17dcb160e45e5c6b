#!/usr/bin/env python
"""The torch peers of the engine (bench/_lib/torch_peer.py) held to model.forward, token by token.

    python bench/torch_peer.py --check
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from _lib.torch_peer import ATOL, RTOL, check  # noqa: E402


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="torch peers of the engine")
    ap.add_argument("--check", action="store_true",
                    help="check TorchStep (S=1 and S streams, both hash modes), TorchBatch and the "
                         "engine against model.forward, token by token")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 0
    n = check()
    print(f"torch_peer --check: OK ({n} peer tokens compared, rtol={RTOL} atol={ATOL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
