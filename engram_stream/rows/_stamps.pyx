# cython: language_level=3
"""FileStamps: the mapped files under a layer's arrays (table, weights), fstat'ed before every
read of an engine (rows/_stamps.pxd declares it). A file truncated (a read past its end dies
with SIGBUS) or rewritten in place (its table mixes with weights read at load) since load
raises FileChangedError, with io.files.MappedFile.check()'s message. The stamp is (device,
inode, size, mtime, ctime, link count), compared as io.files.stamp_changed does (es_stamp_changed):
a file written with its mtime put back (utime) still has a new ctime, which nobody can set. One
fstat a file: cheap enough for every call."""
from libc.stdint cimport int64_t
from posix.stat cimport fstat, struct_stat

cdef extern from "engram_io.h" nogil:
    int es_stamp_changed(const int64_t *s, const struct_stat *st)

from engram_stream.io.files import MappedFile, mapping_of

MAX_FILES = 16  # mapped files one engine checks (a layer spans at most a few checkpoint shards)


cdef class FileStamps:
    """The files under `arrays` that are mapped (io.files.MappedFile), each once, with their
    stamps at load; `what` names the arrays' owner in the error for too many files."""

    def __cinit__(self, arrays, what):
        files = []
        for a in arrays:
            mm = mapping_of(a)
            if isinstance(mm, MappedFile) and all(mm is not f for f in files):
                files.append(mm)
        if len(files) > MAX_FILES:
            raise ValueError(f"{what} spans {len(files)} files, an engine checks at most {MAX_FILES}")
        self.files, self.nfiles = files, len(files)
        for i, f in enumerate(files):
            self.fds[i] = f.fd
            for j, v in enumerate(f.stamp):
                self.stamps[i][j] = v

    cdef int check(self) except -1:
        """Raise FileChangedError if a file changed since load (see the module's docstring)."""
        cdef struct_stat st
        cdef int i
        for i in range(self.nfiles):
            if fstat(self.fds[i], &st) != 0 or es_stamp_changed(self.stamps[i], &st):
                self.files[i].check()  # raises, with the message
        return 0

    def __len__(self):
        return self.nfiles
