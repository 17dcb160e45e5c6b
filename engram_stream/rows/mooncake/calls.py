"""Calls into a Mooncake client, bounded: each runs on a daemon thread and is waited for at most
its timeout (a stopped master never answers); the exit handler closes every open client and
waits for running calls; probing a server's port before a client is made."""
from __future__ import annotations

import queue
import socket
import threading
import time
import weakref


# ---- bounded calls -------------------------------------------------------------------------------
_STUCK = []   # what calls that timed out may still use (clients, buffers): kept for the process's life


def keep_forever(*objs):
    """Keep objects a timed-out call may still use alive until the process ends, past interpreter
    teardown too: a client's destructor talks to its servers (the metadata server sits in the
    master: a stopped one costs seconds per request) and would delay exit."""
    import ctypes
    for o in objs:
        if o is not None:
            _STUCK.append(o)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


_RUNNING = {}   # {done event: deadline (time.monotonic)} of every call started and not ended


class BoundedCalls:
    """Calls run one at a time on a daemon thread, each waited for at most `timeout` seconds. A
    call that times out keeps its thread (it may never return: a stopped master); the next call
    gets a new thread. Daemon threads: nothing joins them at exit, but the exit handler waits
    for a running call until `bound` seconds from its start (_close_at_exit: a call that
    returns while the interpreter finalizes aborts the process)."""

    def __init__(self, name, bound):
        self.name = name
        self.bound = float(bound)
        self._q = None

    def _worker(self, q):
        while True:
            fn, args, box, done = q.get()
            try:
                box.append(fn(*args))
            except BaseException as e:  # handed to the caller
                box.append(e)
                box.append(None)
            _RUNNING.pop(done, None)
            done.set()

    def start(self, fn, *args):
        """Queue fn(*args) on the worker and return at once: a handle for finish()."""
        if self._q is None:
            self._q = queue.SimpleQueue()
            threading.Thread(target=self._worker, args=(self._q,), name=self.name, daemon=True).start()
        box, done = [], threading.Event()
        t0 = time.monotonic()
        _RUNNING[done] = t0 + self.bound
        self._q.put((fn, args, box, done))
        return box, done, t0

    def finish(self, handle, timeout):
        """The started call's result (or its exception); TimeoutError when it has run longer than
        `timeout` seconds since start() (it keeps running)."""
        box, done, t0 = handle
        if not done.wait(max(0.0, t0 + timeout - time.monotonic())):
            self._q = None  # that thread is stuck in fn: leave it there
            raise TimeoutError(f"no answer within {timeout} s")
        if len(box) == 2:
            raise box[0]
        return box[0]

    def call(self, timeout, fn, *args):
        """fn(*args) on the worker; TimeoutError when it takes longer than timeout (it keeps running)."""
        return self.finish(self.start(fn, *args), timeout)


# ---- the exit ---------------------------------------------------------------------------------
OPEN_TIERS = weakref.WeakSet()   # tiers whose client is open: closed at exit (_close_at_exit)
_AT_EXIT = []
_FAULTS = []                # a store call failed or timed out in this process (see _close_at_exit)


def fault():
    _FAULTS.append(True)


EXIT_GRACE = 5.0   # seconds past its bound the exit handler waits for a running call


def _wait_for_running_calls():
    """Wait for every call still running inside a client, each until EXIT_GRACE past its bound:
    a dead store server's call ends with an error a little after the tier's timeout (the client's
    own retries); a stopped master's never ends, and costs the exit that wait."""
    for done, deadline in list(_RUNNING.items()):
        done.wait(max(0.0, deadline + EXIT_GRACE - time.monotonic()))


def _close_at_exit():
    """Close every open tier's client before the interpreter and Mooncake's C++ runtime tear
    down: a client left open at exit (reads done or abandoned, buffers registered) makes that
    teardown abort the process ("terminate called without an active exception"). Registered
    after mooncake.store is imported, so it runs before any exit handler of Mooncake's own.

    After a fault (a failed or timed-out call: a dead server), closing is not enough: Mooncake's
    transport keeps threads of the broken connection, or the call that timed out still runs (its
    client cannot be closed under it), and the C++ static destructors that run in exit() after
    the interpreter is gone abort on them. So the process then ends in exit()'s first handler
    with the status exit() was given (glibc's on_exit hands it to _exit), skipping the C runtime
    handlers registered before it: Python has finished by then (its files are flushed).
    A call still running when the interpreter finalizes would abort it as it returns (its thread
    is ended inside C++ code that may not be unwound), so the calls are waited for first, each
    within its bound."""
    _wait_for_running_calls()
    for tier in list(OPEN_TIERS):
        try:
            tier.close()
        except Exception:  # a client in a bad state: the others still close
            pass
    if _FAULTS:
        import ctypes
        libc = ctypes.CDLL(None)
        if hasattr(libc, "on_exit"):  # glibc; musl has none: its exit is left as it is
            end = ctypes.cast(libc._exit, ctypes.c_void_p)
            libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            libc.on_exit(end, None)   # called as _exit(status, NULL): the extra argument is ignored


def register_close_at_exit():
    if not _AT_EXIT:
        import atexit
        atexit.register(_close_at_exit)
        _AT_EXIT.append(True)


def host_port(addr):
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def wait_for_port(host, port, timeout):
    """Wait until host:port accepts a TCP connection; False after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)


def answers(host, port, request, timeout) -> bool:
    """Whether a server at host:port answers `request` (any reply, or closing the connection)
    within `timeout` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(request)
            s.recv(64)
            return True
    except socket.timeout:
        return False
    except OSError:  # reset or refused: an answer of sorts from a live kernel and process
        return True
