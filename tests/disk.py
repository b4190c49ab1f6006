"""A disk that fills up under DCP's writer, for the full-disk tests of one process (the tmpfs tests in
``test_faults.py`` fill a real one)."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle


class _FullRaw(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: it writes what fits, then raises ENOSPC, as a full disk does."""

    def __init__(self, fd: int, room: int):
        self.fd, self.room = fd, room

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=os.SEEK_SET):
        return os.lseek(self.fd, offset, whence)

    def write(self, b):
        n = min(len(b), self.room)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return os.write(self.fd, bytes(b[:n]))


@contextlib.contextmanager
def disk_with_room(room: int):
    """DCP's files written through Python's buffered file onto a disk with ``room`` bytes left: at 4 kB a
    400 kB tensor's ``torch.save`` raises "unexpected pos 704 vs 598", the ENOSPC only its context (as on a
    full 8 MB tmpfs)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with io.BufferedWriter(_FullRaw(fd, room)) as f:
            yield f

    real = FileSystem.create_stream
    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


def as_the_other_ranks_learn_it(err):
    """DCP's failure as the ranks learn it: each rank's error pickled to the coordinator, which keeps no context."""
    return type(err)(err.args[0], pickle.loads(pickle.dumps(err.failures)))
