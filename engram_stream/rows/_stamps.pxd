# The stat stamps of the mapped files under one engine's arrays (rows/_stamps.pyx): checked
# before every read, so a file truncated or rewritten in place since load is refused.
from libc.stdint cimport int64_t


cdef class FileStamps:
    cdef object files                  # the MappedFiles (their check() raises with the message)
    cdef int nfiles
    cdef int fds[16]
    cdef int64_t stamps[16][6]         # (dev, ino, size, mtime_ns, ctime_ns, nlink) at load

    cdef int check(self) except -1
