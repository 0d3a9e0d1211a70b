"""Writing files and directories so that a reader never sees half of one.

Everything is written under a unique temporary name next to its destination (two writers never
share one), flushed to disk, then renamed into place; on any failure, Ctrl-C included, the
temporary file or directory is removed and the destination is left as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mtp_edge.errors import UserError


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _readable(path: Path, directory: bool) -> None:
    """mkstemp/mkdtemp make private entries; ours are ordinary files (the umask decides)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if directory else 0o666) & ~umask)


def write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` to write a temporary file next to `path`, then rename it into place
    (for writers that take a file name, such as safetensors' save_file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        _readable(tmp, directory=False)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path | None, data: str | bytes) -> None:
    """Write text or bytes to `path` atomically; None writes nothing (an optional output)."""
    if path is None:
        return
    if isinstance(data, str):
        write_with(path, lambda tmp: tmp.write_text(data))
    else:
        write_with(path, lambda tmp: tmp.write_bytes(data))


@contextmanager
def atomic_directory(out: str | Path, suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temporary directory next to `out`; when the block ends without an exception it
    replaces `out` (an older one is moved aside first and removed after), else it is removed."""
    out = Path(out)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    # The writer's process id in the name: a later writer removes what a dead one left.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=suffix, dir=parent))
    _readable(tmp, directory=True)
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync(file)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=parent))
            old.rmdir()
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_output(path: str | Path | None, flag: str, directory: bool = False) -> None:
    """Fail before the work, not after it: `path` (a file, or with `directory` a directory that
    will be replaced) must be creatable where it is. The parent is created and a probe file
    written and removed there, which also catches what permissions alone do not show (a
    read-only or virtual filesystem, root on /proc); folders made for it are removed again."""
    if path is None or str(path) == "-":
        return
    path = Path(path)
    if path.is_dir() and not directory:
        raise UserError(f"{flag} {path} is a directory: give a file name")
    if path.exists() and directory and not path.is_dir():
        raise UserError(f"{flag} {path} is a file: give a directory name")
    parent = path.resolve().parent
    # The folders made for the probe are removed after it: a run refused later for another
    # reason leaves no empty folders behind (every writer here makes its own parents).
    made = [p for p in (parent, *parent.parents) if not p.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
        os.write(fd, b"probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or str(e)
        raise UserError(
            f"{flag} {path}: cannot write in {parent} ({reason}): choose another path"
        ) from None
    finally:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # not made after all, or something else wrote there meanwhile
                pass


def remove_stale_partials(out: str | Path, suffix: str = ".partial") -> list[Path]:
    """Remove temporary directories that dead writers left next to `out` (their names carry
    the writer's process id: see atomic_directory); a live writer's are kept."""
    out = Path(out)
    removed = []
    for tmp in out.resolve().parent.glob(f".{out.name}.*{suffix}"):
        pid = tmp.name[len(out.name) + 2 :].split(".", 1)[0]
        if tmp.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
