"""runlock.py -- the run lock: which process owns a run's output directory.

What it is
    lock(out_dir) is the run lock: one run per directory (flock, dropped by the kernel even on
    SIGKILL); lock_holder(out_dir) asks who holds it without taking it (a refusal writes nothing).
    The lock is an empty file, out_dir/.lock (LOCK), never written: the holder's PID comes from
    /proc/locks. rundir.Run asks lock_holder in check(), before anything is allocated, and takes
    the lock in claim() for the whole run (rank 0 holds it; every rank writes its checkpoint parts
    under it).
What it is not
    Not what makes a checkpoint whole (checkpoint.py: written aside, renamed into place), nor an
    export's or a prepared data directory's guard against a concurrent writer (publish.py).
Try it
    python -m pytest tests/run/test_nothing_lost.py -k stale_lock   # a second run refused; SIGKILL
    python -m pytest tests/run/test_hostile.py -k lock              # --resume names the holder
"""
import fcntl
import os
from pathlib import Path

LOCK = ".lock"                  # the run lock of an output directory (an empty file; see lock())


class LockError(ValueError):
    """Another process holds the run lock of the directory."""


def lock(out_dir):
    """Take the run lock of out_dir (made if missing): an exclusive flock on out_dir/.lock, held
    until the returned file is closed or the process ends -- the kernel drops it even after a
    SIGKILL, so no stale lock survives a crash. Raises LockError naming the PID that holds it (from
    /proc/locks: the file itself is never written, so a refused run changes no byte in the
    directory). The file stays: deleting it would let two runs lock two different files."""
    path = Path(out_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(f)
        f.close()
        raise LockError(f"{path.parent} is in use by another run (pid {holder}, "
                        f"holding {path})") from None
    return f


def lock_holder(out_dir):
    """The PID holding out_dir's run lock, or None (no lock file, or nobody holds it): a probe that
    creates, takes and changes nothing."""
    try:
        f = open(Path(out_dir) / LOCK, "rb")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _lock_holder(f)
    return None   # closing the file dropped the lock this probe took


def _lock_holder(f):
    """The PID holding a flock on the open file f, read from /proc/locks (Linux), or "unknown"."""
    st = os.fstat(f.fileno())
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:   # "1: FLOCK  ADVISORY  WRITE 13995 fe:00:2146902 0 EOF"
            for fields in map(str.split, locks):
                # "->": a process waiting for the lock, not holding it
                if ident in fields and "->" not in fields:
                    return fields[fields.index(ident) - 1]
    except OSError:
        pass
    return "unknown"
