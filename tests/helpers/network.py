"""The session's network: loopback only where it can be (the Mooncake servers' ports). Importing
this module makes the move: conftest.py imports it before any thread starts."""
import os
import sys


def _loopback_only_network():
    """Move this process (its main thread, and so every thread and process it starts later)
    into a fresh network namespace whose one interface is loopback. Why: Mooncake's
    mooncake_master and mooncake_client bind some ports (the HTTP metadata server, the
    transfer engine) on 0.0.0.0 whatever their host flags say; here the only address they
    can listen on is this namespace's 127.0.0.1. Needs CAP_SYS_ADMIN (root, as in CI);
    otherwise nothing changes. ENGRAM_STREAM_TEST_NETNS=0 turns it off. Returns whether
    the namespace is in effect."""
    import ctypes
    import fcntl
    import socket
    import struct
    if os.environ.get("ENGRAM_STREAM_TEST_NETNS") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # lo up: SIOCGIFFLAGS, SIOCSIFFLAGS
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))  # IFF_UP
    return True


LOOPBACK_ONLY = _loopback_only_network()
