"""Files: opening, mapping and atomically replacing them (every variant, every writer).

  open_regular(path, err)   open for reading, refusing FIFOs and devices (err: the error to raise)
  atomic_output(path)       a file object whose bytes become `path` all at once, or not at all
  atomic_folder(path, ok)   a new folder whose files become `path` all at once (swapped in by rename)
  remove_stale_temps(path)  temp files and folders of writers that died (SIGKILL) beside `path`
  MappedFile                a read-only map of a whole file that knows when the file changed
  mapping_of(a)             the mmap an array views, if any
  cache_dir()               the user's cache folder of engram_stream ($XDG_CACHE_HOME/engram_stream)

The rule for mapped files: never truncate or rewrite a checkpoint in place while a model has it
mapped. Reads past a truncated end die with SIGBUS; a rewritten table mixes with weights read
at load. Write a new file and rename it over the old one (every save does): the mapping keeps
the old file, whole, until the model is dropped. MappedFile.check() (one fstat: size, inode,
mtime) refuses a file changed since it was mapped with FileChangedError; engines and forward()
run it before they read a table. A change made while a call is reading cannot be caught.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import shutil
import stat
import weakref

import numpy as np

from ..errors import FileChangedError

__all__ = ["cache_dir", "open_regular", "atomic_output", "atomic_folder", "remove_stale_temps", "MappedFile", "mapping_of", "file_check",
           "check_file", "FileChangedError"]


def cache_dir() -> str:
    """$XDG_CACHE_HOME/engram_stream, else ~/.cache/engram_stream."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "engram_stream")


def open_regular(path, err):
    """The file opened for reading, refused unless it is a regular file: opening a FIFO would
    block (O_NONBLOCK here: it does not) and a device can be read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise err(f"not a regular file (mode {stat.filemode(mode)}): refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _temp_name(path) -> str:
    """A fresh temp name beside `path`: `<name>.tmp-<pid>.<random>` (remove_stale_temps reads the pid)."""
    folder, base = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f"{base}.tmp-{os.getpid()}.{os.urandom(8).hex()}")


# Exclusive: never another save's file, never a symlink planted at the name.
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_destination(path):
    """save() replaces a regular file (or a symlink: the link itself) only. Renaming over a
    FIFO or a device node would silently swap it for a file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise ValueError(f"{path}: exists and is not a regular file ({stat.filemode(mode)}): not replaced")


def remove_stale_temps(path) -> list:
    """Delete the temp files (and temp folders) of `path` left by writers in processes that no
    longer run (killed mid-write). Every save runs it first. A temp of a live process, or one
    whose pid is unreadable, stays."""
    removed = []
    prefix = f"{os.path.basename(os.path.abspath(path))}.tmp-"
    folder = os.path.dirname(os.path.abspath(path))
    for name in os.listdir(folder):
        pid = name[len(prefix):].split(".", 1)[0]  # <pid>.<random> (or <pid>: older files)
        if not (name.startswith(prefix) and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or a new process that reuses the pid: keep its file)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        try:
            _remove(os.path.join(folder, name))
            removed.append(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    return removed


def _remove(path):
    """Remove a file, a symlink (not its target) or a whole folder."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


@contextlib.contextmanager
def atomic_output(path):
    """A binary file object whose bytes become `path` all at once, or not at all: they go to a
    temp file of this call's own beside `path` (created exclusively, no symlink followed), are
    fsynced, then renamed over `path`. Whatever stops the writer (an error, SIGTERM turned into
    an exception by the CLI) removes the temp file and leaves `path` as it was; the temps of
    writers that were killed (SIGKILL: no cleanup runs) are swept first."""
    _check_destination(path)
    remove_stale_temps(path)
    tmp = _temp_name(path)
    try:  # from the open on
        with os.fdopen(os.open(tmp, _TEMP_FLAGS, 0o666), "wb") as f:  # 0666 & ~umask, as open() gives
            yield f
            f.flush()
            os.fsync(f.fileno())  # data on disk before the rename makes it visible
        _check_destination(path)  # again: it may have appeared while we wrote
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException as e:
        if not (isinstance(e, FileExistsError) and e.filename == tmp):  # else not ours: left alone
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise


def _check_folder_destination(path, replaceable):
    """A folder save replaces a folder whose every entry replaceable(name) accepts (what that
    format writes, so nothing of the user's is deleted), or a symlink (the link itself)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        return
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{path}: exists and is not a folder ({stat.filemode(mode)}): not replaced")
    foreign = sorted(n for n in os.listdir(path) if not replaceable(n))
    if foreign:
        raise ValueError(f"{path}: holds files this save does not write ({', '.join(foreign[:5])}"
                         f"{', ...' if len(foreign) > 5 else ''}): not replaced (save to a new folder, or move "
                         f"them out first)")


@contextlib.contextmanager
def atomic_folder(path, replaceable):
    """A new folder whose files become `path` all at once, or not at all: the caller writes them
    into the temp folder yielded (beside `path`, this call's own); each file and the folder are
    then fsynced and the folder is swapped in with one rename (renameat2 RENAME_EXCHANGE over an
    existing folder, then the old one is deleted): a reader sees the old folder or the new one,
    never a mix. Where the exchange is unsupported the old folder is renamed aside first (a
    moment with no folder at `path`, still never a mix). An existing `path` must be a folder
    whose every entry replaceable(name) accepts (else ValueError, nothing written). Temps of
    dead writers are swept first; an error or a signal removes this call's temp folder."""
    path = os.path.abspath(os.fspath(path))
    _check_folder_destination(path, replaceable)
    remove_stale_temps(path)
    tmp = _temp_name(path)
    os.mkdir(tmp, 0o777)  # & ~umask, as mkdir gives
    old = None
    try:
        yield tmp
        for name in os.listdir(tmp):
            _fsync_path(os.path.join(tmp, name))
        _fsync_dir(tmp)
        _check_folder_destination(path, replaceable)  # again: it may have changed while we wrote
        old = _swap_in(tmp, path)
        _fsync_dir(os.path.dirname(path))
    except BaseException:
        if old is None and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None and old is not _NOTHING:
        _remove(old)  # killed before this: a stale temp, swept by the next save


_NOTHING = object()


def _swap_in(new, path):
    """Put folder `new` at `path`; returns where the old `path` went (_NOTHING: there was none)."""
    for _ in range(100):  # another save may create or swap `path` between our calls
        if not os.path.lexists(path):
            try:
                os.rename(new, path)  # fails on an existing non-empty folder: never replaces one
                return _NOTHING
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                continue
        if _exchange(new, path):
            return new  # the old folder now sits at the temp name
        aside = _temp_name(path)  # no atomic exchange here: the old folder steps aside first
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(aside, path)
            raise
        return aside
    raise OSError(errno.EBUSY, f"{path}: kept changing while this save swapped its folder in")


_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}


def _exchange(a, b) -> bool:
    """Atomically exchange paths a and b (Linux renameat2 RENAME_EXCHANGE). False where the
    system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    AT_FDCWD = -100
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif platform.machine() in _SYS_RENAMEAT2:
        rc = libc.syscall(_SYS_RENAMEAT2[platform.machine()], AT_FDCWD, os.fsencode(a), AT_FDCWD,
                          os.fsencode(b), _RENAME_EXCHANGE)
    else:
        return False
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(e, os.strerror(e), b)


def _fsync_path(p):
    """fsync a regular file (symlinks and others: nothing to sync)."""
    if not os.path.isfile(p) or os.path.islink(p):
        return
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d):
    """Make the rename durable too (best effort: not every file system lets us open a dir)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stamp(st):
    """(device, inode, size, mtime_ns, ctime_ns, nlink) of an os.stat result (stamp_changed)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink


def stamp_changed(was, now) -> bool:
    """Whether a file stamped `was` at open is changed at `now` (_stamp's tuples): its device,
    inode, size or mtime differ, or its ctime does while its link count is the one at open. A
    write with the mtime put back (utime) moves the ctime, which nobody can set; a link added or
    removed moves it too (a new file renamed over this one unlinks it, and readers keep the old
    inode), so a changed link count leaves the ctime out. include/engram_io.h's
    es_stamp_changed is the same rule in C."""
    return tuple(now[:4]) != tuple(was[:4]) or (now[4] != was[4] and now[5] == was[5])


class MappedFile(mmap.mmap):
    """A read-only map of a whole open file that remembers the file as it was mapped: check()
    raises FileChangedError once its size, inode or mtime differ (see the rule above).
    st: the os.fstat of fd that the caller validated the file with."""

    def __new__(cls, fd, st, path):
        self = super().__new__(cls, fd, st.st_size, access=mmap.ACCESS_READ)
        self.path, self.stamp = os.path.abspath(path), _stamp(st)  # reopened later (direct reads): cwd may move
        self.fd = os.dup(fd)  # the mapping's own fd is not reachable; fstat needs one (engines too)
        weakref.finalize(self, os.close, self.fd)
        return self

    def check(self):
        now = _stamp(os.fstat(self.fd))
        if stamp_changed(self.stamp, now):
            what = "truncated" if now[2] < self.stamp[2] else "rewritten in place"
            raise FileChangedError(
                f"{self.path}: {what} after it was mapped (size {self.stamp[2]} -> {now[2]} bytes, mtime "
                f"{'changed' if now[3] != self.stamp[3] else 'same, ctime changed'}): its tables can no longer be read "
                f"safely. Do not modify a mapped checkpoint in place: write a new file, rename it over "
                f"the old one (as save() does) and load it again")


def file_check(a):
    """The check() of the MappedFile under array `a` (raises FileChangedError when the file
    changed since it was mapped), or None when `a` is not a view of one."""
    mm = mapping_of(a)
    return mm.check if isinstance(mm, MappedFile) else None


def check_file(a):
    """Raise FileChangedError when `a` views a MappedFile whose file changed since it was mapped."""
    check = file_check(a)
    if check is not None:
        check()


def mapping_of(a):
    """The mmap.mmap whose memory `a` views (walking .base), or None for ordinary memory.
    (An anonymous mmap.mmap(-1, n) counts too: Python does not tell them apart.)"""
    b = a
    while b is not None:
        if isinstance(b, mmap.mmap):
            return b
        if isinstance(b, memoryview):
            b = b.obj
        elif isinstance(b, np.memmap) and getattr(b, "_mmap", None) is not None:
            return b._mmap
        else:
            b = getattr(b, "base", None)
    return None
