"""publish.py -- a directory of outputs written aside, then put in place whole: never over what
another process put there meanwhile, never by renaming a directory that exists (a mount point,
the working directory).

What it is
    The way prepare (prepare.py) and the Hugging Face exports (hf.save_hf) put a directory in place:
      stage(out)    the directory to write into: a sibling .tmp-NAME-PID when out does not exist,
                    else .tmp-PID inside out (empty, or an earlier output the caller may replace):
                    on out's own filesystem, so that a mount point works too. What dead writers
                    left (a kill, an out-of-memory abort) is removed first.
      publish(tmp, out, expect, state, last, old)
                    under an flock of out's parent, held for the swap alone: state(out) must still
                    be `expect`, what the caller saw when it checked out: an output another
                    process put there meanwhile wins, and this one raises Conflict, replacing
                    nothing. Then the sibling is renamed to out (atomic); or, inside out, `last`
                    (the file whose presence says the rest is whole: meta.json, the export marker)
                    is removed, the staged files are renamed over their namesakes, the earlier
                    output's files (`old`) not written again are removed, and `last` comes last.
                    out's inode never changes: a shell in it, a mount, stay.
      writers(out)  the PIDs of live processes staging into out (another prepare or export)
      alive(pid)    whether the PID at the tail of a staging directory's name is running
      inside(d, name)
                    d / name, where `name` was read from a file (an export's marker, a prepared
                    meta.json, a checkpoint's): untrusted, so refused (Unsafe) when it is absolute,
                    holds '..' or resolves, symlinks included, outside d. publish() removes only
                    names that pass it.
What it is not
    Not a transaction over several directories, and not a run's lock (runlock.py is that).
"""
import fcntl
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


class Conflict(ValueError):
    """Another process put an output at the same place while this one was writing. One line."""


class Unsafe(ValueError):
    """A file name read from a file would reach outside its directory. One line."""


def inside(directory, name):
    """directory / name, when `name` (read from a file we did not just write) names something
    inside directory: a relative path of plain parts (no '', '.', '..'), that does not resolve
    (symlinks included) outside it. Else Unsafe: a crafted list would make a caller read or remove
    elsewhere."""
    d = Path(directory)
    plain = isinstance(name, str) and "\0" not in name and "\\" not in name
    parts = name.split("/") if plain else []
    if not parts or any(part in ("", ".", "..") for part in parts):
        raise Unsafe(f"{d} lists {name!r} among its files, which is not a file name inside it "
                     "(absolute, '..' or empty): the list was edited; nothing was changed")
    target = d / name
    if not target.resolve().is_relative_to(d.resolve()):
        raise Unsafe(f"{d} lists {name!r} among its files, which resolves outside it (a symlink "
                     f"to {target.resolve()}); nothing was changed")
    return target


def alive(pid):
    """Is `pid` (the tail of a .tmp-* name) another process that is still running? A tail that is
    no PID counts as alive (whatever it is, it is left alone); this process's own PID does not (a
    directory of a dead process that had it before us)."""
    if not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:                      # someone else's process
        return True
    return True


def staged(out):
    """[(path, pid)] of out's staging directories: siblings .tmp-NAME-PID, .tmp-PID inside it."""
    out = Path(out)
    sib = re.compile(rf"\.tmp-{re.escape(out.name)}-(\d+)")
    found = [(p, m[1]) for p in out.parent.glob(".tmp-*") if (m := sib.fullmatch(p.name))]
    if out.is_dir():
        found += [(p, m[1]) for p in out.glob(".tmp-*")
                  if (m := re.fullmatch(r"\.tmp-(\d+)", p.name))]
    return found


def is_staging(path):
    """Whether `path`, an entry of an output directory, is a staging directory (.tmp-PID)."""
    return re.fullmatch(r"\.tmp-\d+", Path(path).name) is not None


def writers(out):
    """The PIDs of live processes (not this one) writing into out now."""
    return [int(pid) for _, pid in staged(out) if alive(pid)]


def stage(out):
    """A new, empty directory to write out's files into (see the module docstring)."""
    out = Path(out)
    for p, pid in staged(out):
        if not alive(pid):
            shutil.rmtree(p, ignore_errors=True)
    pid = os.getpid()
    tmp = out / f".tmp-{pid}" if out.is_dir() else out.parent / f".tmp-{out.name}-{pid}"
    tmp.mkdir(parents=True)
    return tmp


@contextmanager
def locked(directory):
    """An exclusive flock of `directory` (blocking) for the duration: an output's swap in it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # drops the lock


def publish(tmp, out, expect, state, last, old=()):
    """Put the files of `tmp` (stage(out)) at out, see the module docstring. Raises Conflict, out
    as another process left it and tmp removed, when state(out) is no longer `expect`."""
    tmp, out = Path(tmp), Path(out)
    try:
        for name in old:                      # a crafted list: refused before anything changes
            inside(out, name)
        with locked(out.parent):
            if state(out) != expect:
                raise Conflict(f"{out} was written by another process while this one ran; nothing "
                               f"there was replaced")
            if tmp.parent != out:                # out was absent (or is an empty directory)
                os.rename(tmp, out)
                fsync_dir(out.parent)
                return out
            new = sorted(p.name for p in tmp.iterdir())
            if (out / last).exists():
                os.unlink(out / last)            # from here out is not a finished output
            for name in [n for n in old if n not in new] + [n for n in new if n != last]:
                target = out / name                  # old: checked by inside() above
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    os.unlink(target)
                if name in new:
                    os.rename(tmp / name, target)
            fsync_dir(out)
            os.rename(tmp / last, out / last)    # last: its presence says the rest is whole
            os.rmdir(tmp)
            fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def fsync_dir(path):
    """Make a directory's entries (a rename, a new file) durable: fsync the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
