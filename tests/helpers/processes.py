"""Subprocesses of the tests: Python run from a folder outside the checkout (whose unbuilt source
would shadow the package under test), on a terminal, and counted for native allocations."""
import os
import subprocess
import sys
import tempfile


def run_python(args, cwd=None, **kw):
    """subprocess.run([sys.executable, *args]) from a folder outside the checkout."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)


def run_python_on_a_terminal(args, timeout=300):
    """run_python with stderr on a terminal (a pseudo-terminal: where progress bars show) and
    stdout a pipe. Both are read while it runs, so a long bar cannot fill the terminal's buffer
    and stall it. Returns a CompletedProcess whose stderr is what the terminal showed (text)."""
    import pty
    import select
    import time
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, *args], cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                             stderr=slave)
    finally:
        os.close(slave)
    out_fd = p.stdout.fileno()
    chunks = {master: [], out_fd: []}
    reading = set(chunks)
    deadline = time.monotonic() + timeout
    try:
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(p.args, timeout)
            for fd in select.select(sorted(reading), [], [], left)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the terminal's last writer closed it
                    chunk = b""
                if chunk:
                    chunks[fd].append(chunk)
                else:
                    reading.discard(fd)
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        os.close(master)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_fd, master))
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def start_python(args, cwd=None, **kw):
    """subprocess.Popen([sys.executable, *args]) from a folder outside the checkout (a process
    the test talks to while it runs)."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)


def native_allocations(run):
    """[count, bytes] of the native allocations memray.Tracker records while run() runs (frees and
    unmaps not counted). For the allocation tests' subprocesses, which import this module."""
    import memray
    fn = os.path.join(tempfile.mkdtemp(), "t.bin")
    with memray.Tracker(fn):
        run()
    frees = {memray.AllocatorType.FREE, memray.AllocatorType.MUNMAP}
    recs = [r for r in memray.FileReader(fn).get_allocation_records()
            if memray.AllocatorType(r.allocator) not in frees]
    os.unlink(fn)
    return [len(recs), sum(r.size for r in recs)]
