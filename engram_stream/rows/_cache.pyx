# cython: language_level=3
"""RowCache: a fixed RAM budget of whole table rows in front of a table source.

The rules (open-addressing index keyed by absolute row, GCLOCK eviction, pins by
count) and the region's layout and lock are in include/engram_rowcache.h; this class owns
the region its readers (rows/_source.pyx CachedRows: every engine of the layer) change
under that lock: the process's own memory, or one file under /dev/shm that every process of
a host maps (host=: a host's ranks share one budget, and a row one of them read is a hit for
all; DESIGN.md section 10 has the protocol).
"""
import numpy as np
cimport numpy as cnp
import fcntl
import os
import secrets
from stat import S_IMODE, S_ISLNK, S_ISREG

from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy, memset, strerror
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.stat cimport fstat, lstat, struct_stat
from posix.unistd cimport close, getpid, unlink

cnp.import_array()

SLOT_ALIGN = 64  # the slots start on a cache line
HOST_TRIES = 64  # attaches that may lose a race with a last user removing the file


def slot_bytes(int64_t recbytes):
    """Bytes one cached row costs in slots: its record rounded up to a cache line (64) when that
    costs at most an eighth more, else to 8 bytes. A line-aligned record touches no extra line,
    but V4.1's 264-byte record would take 320 bytes: 21% fewer rows in the same RAM."""
    cdef int64_t line = (recbytes + 63) // 64 * 64
    return line if 8 * (line - recbytes) <= recbytes else (recbytes + 7) // 8 * 8


def _index_entries(int64_t nslots):
    cdef int64_t size = 1
    while size < 2 * nslots:
        size *= 2
    return size


cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from "sys/file.h" nogil:
    int flock(int fd, int operation)
    int LOCK_EX, LOCK_NB

cdef int64_t HUGE = 2 << 20

cdef int64_t _layout(int64_t nslots, int64_t recbytes, int64_t *o) noexcept:
    return es_rc_layout(nslots, slot_bytes(recbytes), _index_entries(nslots), o, o + 1, o + 2, o + 3, o + 4)


def cache_nbytes(int64_t nslots, int64_t recbytes):
    """RAM a RowCache of nslots rows holds: head (layout, lock, counters), index (a power of
    two >= 2 per row), keys, pin counts, use counters and slots, each part on its own lines."""
    cdef int64_t o[5]
    return _layout(nslots, recbytes, o)


def slots_for(int64_t budget_bytes, int64_t recbytes):
    """The most rows a cache can hold within budget_bytes (everything counted)."""
    if cache_nbytes(0, recbytes) > budget_bytes:
        return 0
    lo, hi = 0, max(0, budget_bytes // (slot_bytes(recbytes) + 2 * 8 + 8 + 4 + 1))
    while lo < hi:  # cache_nbytes grows with n: the last n that fits
        mid = (lo + hi + 1) // 2
        if cache_nbytes(mid, recbytes) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _mismatch(path, dict theirs, dict ours):
    diff = ", ".join(f"{k} {theirs[k]!r} (this process: {ours[k]!r})" for k in ours if theirs[k] != ours[k])
    return ValueError(
        f"{os.fsdecode(path)}: the host row cache there holds another layout, and processes use it: {diff}. "
        f"Every process sharing a host cache must load the same model with the same row_cache_mb: give "
        f"this one their settings, or another host_cache name (a file no process uses is replaced)")


def _untrusted(path, st, why):
    p = os.fsdecode(path)
    return PermissionError(
        f"{p}: refusing the host row cache file there: {why} (owner uid {st.st_uid}, mode "
        f"{oct(S_IMODE(st.st_mode))}; this process runs as uid "
        f"{os.geteuid()}). A host cache file must be a regular file (not a link) owned by the user of the "
        f"processes sharing it and writable by no one else: any local user can create files in "
        f"{os.path.dirname(p)}, and one who made this one could plant rows or hold its lock. Remove it "
        f"(rm {p}) if it is a stale file of yours, or choose another host_cache name")


def _distrust(st):
    """Why a host cache file with this (l)stat cannot be trusted, or None."""
    if S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return "owned by another user"
    if st.st_mode & 0o022:
        return "writable by group or others"
    return None


def _open_trusted(path):
    """The host cache file at `path` open read-write, or None when there is none. A file is
    refused (PermissionError, not removed) unless this user owns it, no one else can write it and
    it is a regular file reached without a symbolic link: checked on the open file before it is
    locked or read, so a planted file can neither serve its rows nor hold this process in flock.
    Refused rather than replaced: in a sticky /dev/shm only its owner (or root) may remove it,
    and what another user put there is not this process's to delete."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link; EISDIR; EACCES: another user's file
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        why = _distrust(st)
        if why is None:
            raise
        raise _untrusted(path, st, why) from None
    st = os.fstat(fd)
    why = _distrust(st)
    if why is not None:
        os.close(fd)
        raise _untrusted(path, st, why)
    return fd


cdef class RowCache:
    """A cache of `nslots` row records of `recbytes` bytes each (layer: a label for stats;
    totals: an int64[4] that hits, misses, bytes_fetched, evictions are added to at the end).
    host: a path under /dev/shm naming the host's cache of these rows (identity: what they are,
    e.g. model and layer, at most 95 bytes): the first process creates it, the others attach
    (the same nslots, recbytes and identity, else ValueError), the last one to go removes it;
    stats() are then the host's (every process's lookups). A file there that another user could
    have written (or a link) is refused: PermissionError."""

    COUNTERS = ("hits", "misses", "bytes_fetched", "evictions")

    def __cinit__(self, int64_t nslots, int64_t recbytes, layer=None, totals=None, host=None, identity=""):
        self.fd = -1
        self.pid = getpid()
        if nslots < 0 or recbytes < 0:
            raise ValueError(f"RowCache needs nslots >= 0 and recbytes >= 0, got {nslots}, {recbytes}")
        if totals is not None and not (isinstance(totals, np.ndarray) and totals.dtype == np.int64
                                       and totals.shape == (4,)):
            raise ValueError("totals must be an int64[4] array")
        if totals is not None and host is not None:
            raise ValueError("totals= is for a process's own cache: a host cache's counters are the host's")
        ident = identity.encode()
        if len(ident) >= ES_RC_IDENTITY or b"\0" in ident:
            raise ValueError(f"RowCache identity must be at most {ES_RC_IDENTITY - 1} bytes, no NUL: {identity!r}")
        cdef int64_t size = _index_entries(nslots)
        cdef int bits = 0
        while (<int64_t> 1 << bits) < size:
            bits += 1
        cdef int64_t o[5]
        cdef int64_t total = _layout(nslots, recbytes, o)
        self.layer = layer
        self._totals = totals
        self.c.nslots, self.c.recbytes, self.c.stride = nslots, recbytes, slot_bytes(recbytes)
        self.c.mask, self.c.shift = size - 1, 64 - bits
        if host is None:
            self._map(-1, total)
            err = es_rc_init_head(&self.c, o[0], total, ident)
            if err:
                raise OSError(err, f"RowCache: the lock: {strerror(err).decode()}")
            return
        path = os.fsencode(host)
        for _ in range(HOST_TRIES):
            fd = _open_trusted(path)
            if fd is None:
                if self._create(path, total, ident):
                    break
                continue
            if self._join(fd, path, total, ident):
                break
        else:
            raise RuntimeError(f"{host}: could not attach the host row cache in {HOST_TRIES} tries (its last users "
                               f"kept removing it): try again")
        self.host = path

    cdef int _map(self, int fd, int64_t total) except -1:
        """Map the region (fd -1: the process's own zeroed memory) and point the struct into it.
        Pages come in as they are touched; a large region asks for transparent huge pages first:
        a big cache is read at random, and with 4 KiB pages nearly every lookup would also miss
        the TLB (advice only: refused, it changes nothing)."""
        cdef int64_t o[5]
        cdef void *p
        if fd < 0:
            p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        else:
            p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"RowCache: cannot map {total} bytes for {self.c.nslots} rows: "
                                 f"{strerror(errno).decode()}")
        self.base, self.mapped = <char *> p, total
        if total >= 2 * HUGE:
            madvise(p, total, MADV_HUGEPAGE)
        _layout(self.c.nslots, self.c.recbytes, o)
        self.c.head = <es_rc_head *> p
        self.c.index = <int64_t *> (self.base + o[0])
        self.c.keys = <int64_t *> (self.base + o[1])
        self.c.refs = <int32_t *> (self.base + o[2])
        self.c.uses = <uint8_t *> (self.base + o[3])
        self.c.data = self.base + o[4]
        return 0

    cdef int _create(self, bytes path, int64_t total, bytes identity) except -1:
        """A fresh host file, made whole under a temporary name and then linked to `path` (link
        never replaces: of two processes creating at once one wins, the other attaches to it).
        1: this process made it and uses it; 0: another made it first."""
        cdef int64_t o[5]
        tmp = path + b".%d.%s.tmp" % (os.getpid(), secrets.token_hex(4).encode())
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: its user reads and writes it, no one else
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use by this process from the start
            try:  # every page now: a full /dev/shm fails here, not as a SIGBUS at some later read
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise OSError(e.errno, f"{os.fsdecode(path)}: no room for a host row cache of {total} bytes "
                                       f"({e.strerror}): see df -h {os.path.dirname(os.fsdecode(path))}; a "
                                       f"smaller row_cache_mb or a larger /dev/shm (docker --shm-size)") from None
            self._map(fd, total)
            _layout(self.c.nslots, self.c.recbytes, o)
            err = es_rc_init_head(&self.c, o[0], total, identity)
            if err:
                raise OSError(err, f"RowCache: the lock: {strerror(err).decode()}")
            try:
                os.link(tmp, path)
            except FileExistsError:
                munmap(self.base, self.mapped)
                self.base = NULL
                os.close(fd)
                return 0
        except BaseException:
            if self.base != NULL:
                munmap(self.base, self.mapped)
                self.base = NULL
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        self.fd = fd
        return 1

    cdef int _join(self, int fd, bytes path, int64_t total, bytes identity) except -1:
        """Attach the host file open at fd: flock it shared (exclusive first: a process that gets
        it is the only user, so pins left in it are a dead process's), check that `path` still
        names it (a last user may have removed it meanwhile: 0, try again) and that its layout
        is this one's. A file nobody uses that holds another layout is removed (0); one that
        holds this layout is checked whole (es_rc_sound) and rebuilt if any of it is garbage."""
        cdef bint alone = True
        cdef es_rc_head h
        cdef int64_t o[5]
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                alone = False
                fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                os.close(fd)
                return 0
            raw = os.pread(fd, sizeof(es_rc_head), 0)
            memset(&h, 0, sizeof(h))
            memcpy(&h, <const char *> raw, len(raw))
            theirs = {"format": (h.magic == ES_RC_MAGIC, h.version), "bytes": (st.st_size, h.total_bytes),
                      "rows": h.nslots, "record bytes": h.recbytes,
                      "identity": h.identity[:ES_RC_IDENTITY - 1].split(b"\0")[0].decode(errors="replace")}
            ours = {"format": (True, ES_RC_VERSION), "bytes": (total, total), "rows": self.c.nslots,
                    "record bytes": self.c.recbytes, "identity": identity.decode()}
            if theirs != ours:
                if alone:
                    os.unlink(path)
                    os.close(fd)
                    return 0
                raise _mismatch(path, theirs, ours)
            self._map(fd, total)
            if alone:  # no process uses it: pins in it were left by dead ones, and garbage is dropped
                seen = np.empty(max(self.c.nslots, 1), np.uint8)
                if es_rc_sound(&self.c, <uint8_t *> cnp.PyArray_DATA(seen)):
                    memset(self.c.refs, 0, max(self.c.nslots, 1) * sizeof(int32_t))
                    err = es_rc_init_lock(self.c.head)
                    if err:
                        raise OSError(err, f"RowCache: the lock: {strerror(err).decode()}")
                else:  # nobody can be in it: made again in place, as _create makes it (its rows dropped)
                    _layout(self.c.nslots, self.c.recbytes, o)
                    memset(self.base + o[0], 0, o[4] - o[0])
                    err = es_rc_init_head(&self.c, o[0], total, identity)
                    if err:
                        raise OSError(err, f"RowCache: the lock: {strerror(err).decode()}")
                    self.c.head.recoveries = 1
                fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            if self.base != NULL:
                munmap(self.base, self.mapped)
                self.base = NULL
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        self.fd = fd
        return 1

    def __dealloc__(self):
        cdef struct_stat a, b
        if self.base != NULL:
            if self._totals is not None:
                h = self.c.head
                self._totals += (h.hits, h.misses, h.bytes_fetched, h.evictions)
            munmap(self.base, self.mapped)
        if self.fd >= 0:
            # the last user (no other holds its flock) removes the file, if `path` still names it;
            # a forked child shares its parent's open file and flock: it only closes its copy
            if self.pid == getpid() and flock(self.fd, LOCK_EX | LOCK_NB) == 0 and fstat(self.fd, &a) == 0 \
                    and lstat(<const char *> self.host, &b) == 0 and a.st_ino == b.st_ino and a.st_dev == b.st_dev:
                unlink(<const char *> self.host)
            close(self.fd)

    @property
    def nslots(self):
        return self.c.nslots

    @property
    def recbytes(self):
        return self.c.recbytes

    @property
    def nbytes(self):
        """RAM the cache holds (head, index, keys, pins, counters, slots)."""
        return self.mapped

    @property
    def recoveries(self):
        """Times the rows were dropped (es_rc_forget): a process took the lock over from a holder
        that died holding it, or met garbage in the region (a rebuilt region starts at 1)."""
        return self.c.head.recoveries

    def stats(self):
        """The counters (a host cache: every process's) and sizes."""
        es_rc_lock(&self.c)
        out = {"hits": self.c.hits, "misses": self.c.misses, "bytes_fetched": self.c.bytes_fetched,
               "evictions": self.c.evictions, "rows_cached": self._cached(),
               "capacity_rows": self.c.nslots, "cache_bytes": self.nbytes}
        es_rc_unlock(&self.c)
        return out

    cdef int64_t _cached(self) noexcept:
        """Rows held (under the lock). Every slot below `used` holds one, unless a recovery freed
        some (es_rc_forget): count them then."""
        cdef int64_t s, n = 0
        if self.c.head.recoveries == 0:
            return self.c.used
        for s in range(self.c.used):
            n += self.c.keys[s] >= 0
        return n

    def pinned(self):
        """Pins held now, summed over slots (a reader holds one per position of the call it is
        reading: CachedRows); 0 when no reader is between a submit and its release."""
        cdef int64_t s, n = 0
        es_rc_lock(&self.c)
        for s in range(self.c.nslots):
            n += self.c.refs[s]
        es_rc_unlock(&self.c)
        return n

    def __contains__(self, row):
        es_rc_lock(&self.c)
        s = es_rc_peek(&self.c, row)
        es_rc_unlock(&self.c)
        return s >= 0

    def __len__(self):
        es_rc_lock(&self.c)
        n = self._cached()
        es_rc_unlock(&self.c)
        return n

    def rows(self):
        """int64: the rows cached now (sorted)."""
        es_rc_lock(&self.c)
        keys = np.asarray(<int64_t[:max(self.c.used, 1)]> self.c.keys)[:self.c.used].copy()
        es_rc_unlock(&self.c)
        return np.sort(keys[keys >= 0])

    def touch(self, rows):
        """Look every row of `rows` up in order, as an engine's reads would (a miss takes a slot,
        CLOCK evicting), without any bytes: the hit-rate model of a cache this size (recbytes 0
        holds keys only). Returns the hits among them; the counters count them too."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        cdef int64_t i, s, n = r.shape[0], hits = 0
        with nogil:
            es_rc_lock(&self.c)
            for i in range(n):
                s = es_rc_peek(&self.c, pr[i])
                if s >= 0:
                    es_rc_hit(&self.c, s)
                    hits += 1
                else:
                    self.c.misses += 1
                    es_rc_insert(&self.c, pr[i])
            es_rc_unlock(&self.c)
        return hits

    def read(self, rows, cnp.ndarray records):
        """Read `rows` through the cache from `records` (uint8[N, recbytes], standing in for a
        table): what an engine's gather does per row. Returns uint8[len(rows), recbytes]."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        if records.dtype != np.uint8 or records.ndim != 2 or records.shape[1] != self.c.recbytes \
                or not records.flags.c_contiguous:
            raise ValueError(f"records must be a C-contiguous uint8 [N, {self.c.recbytes}] array")
        if r.size and (r.min() < 0 or r.max() >= records.shape[0]):
            raise IndexError("rows out of range")
        out = np.empty((r.shape[0], self.c.recbytes), dtype=np.uint8)
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        cdef const char *tab = <const char *> cnp.PyArray_DATA(records)
        cdef char *po = <char *> cnp.PyArray_DATA(out)
        cdef int64_t i, n = r.shape[0], rb = self.c.recbytes
        cdef const char *p
        with nogil:
            es_rc_lock(&self.c)
            for i in range(n):
                p = es_rc_row(&self.c, pr[i], tab, rb, NULL, 0)
                if p == NULL:
                    p = tab + pr[i] * rb
                memcpy(po + i * rb, p, rb)
            es_rc_unlock(&self.c)
        return out
