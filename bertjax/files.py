"""Files of a run, local or remote: read without TensorFlow where it is not needed, written so a
kill never leaves half a file.

Local paths go through `os` and `open`; a URL (gs://...) through `tf.io.gfile`, the one reader of
such URLs bertjax installs, imported then only (TensorFlow takes seconds to import, and reading a
weights folder or a JSON record should not cost that).

`read_json` names the file and the fix when it is cut short or not JSON: a bare JSONDecodeError
says neither. `write_text` / `write_json` write a temporary file beside the target and rename it
over the target, so a reader sees the old file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from typing import Any, Callable, Iterator


def _is_url(path: str) -> bool:
  return "://" in path


def _gfile():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.io.gfile


def open_file(path: str, mode: str = "rb"):
  if _is_url(path):
    return _gfile().GFile(path, mode)
  return open(path, mode)  # pylint: disable=unspecified-encoding


def exists(path: str) -> bool:
  return _gfile().exists(path) if _is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _gfile().isdir(path) if _is_url(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
  if _is_url(path):
    return [name.rstrip("/") for name in _gfile().listdir(path)]
  return os.listdir(path)


def makedirs(path: str) -> None:
  if _is_url(path):
    _gfile().makedirs(path)
  else:
    os.makedirs(path, exist_ok=True)


class DamagedFileError(ValueError):
  """A file bertjax wrote is cut short or not what it should hold (said with the file's path)."""


def read_json(path: str, what: str = "") -> Any:
  """The JSON in `path`; a file cut short or not JSON raises DamagedFileError naming it (`what`
  says what the file is, for the message)."""
  with open_file(path, "r") as f:
    text = f.read()
  try:
    return json.loads(text)
  except json.JSONDecodeError as err:
    kind = f" ({what})" if what else ""
    raise DamagedFileError(
        f"{path}{kind} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}; "
        f"{len(text)} characters): it was cut short or overwritten. Restore it from a copy, or "
        "move it away if it can be rebuilt (a run rewrites its own records).") from None


def write_text(path: str, text: str) -> None:
  """Writes `text` to `path` atomically: a temporary file beside it, then a rename."""
  tmp = f"{path}.tmp-{os.getpid()}"
  if _is_url(path):
    gfile = _gfile()
    with gfile.GFile(tmp, "w") as f:
      f.write(text)
    gfile.rename(tmp, path, overwrite=True)
    return
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json(path: str, value: Any) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def copy(source: str, target: str) -> None:
  """Copies `source` to `target` atomically (a temporary file beside it, then a rename)."""
  tmp = f"{target}.tmp-{os.getpid()}"
  if _is_url(source) or _is_url(target):
    gfile = _gfile()
    gfile.copy(source, tmp, overwrite=True)
    gfile.rename(tmp, target, overwrite=True)
    return
  shutil.copyfile(source, tmp)
  os.replace(tmp, target)


# A full disk -----------------------------------------------------------------------------------

class DiskFullError(OSError):
  """A write found no space left (errno ENOSPC), said in one line naming the folder."""

  def __init__(self, message: str):
    super().__init__(message)
    self.errno = errno.ENOSPC


_NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


def is_disk_full(err: BaseException | None) -> bool:
  """Whether `err`, or an error it was raised from or during, is a write that found no space left:
  an OSError with errno ENOSPC, or the C libraries' errors that carry its text (tensorstore, which
  writes orbax's arrays, raises a ValueError "RESOURCE_EXHAUSTED: ... No space left on device";
  TensorFlow's file writes their own error). Orbax raises a failed save again at every later
  wait, each during the last, so the cause can lie several links down the chain."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
      return True
    if _NO_SPACE in str(err):
      return True
    err = err.__cause__ or err.__context__
  return False


@contextlib.contextmanager
def disk_full_said(folder: str, kept: Callable[[], str]) -> Iterator[None]:
  """Turns a full disk met inside into one DiskFullError naming `folder` and what is kept
  (`kept()`, asked then): otherwise orbax's background save, failing at each wait, ends a run with
  a score of chained tracebacks."""
  try:
    yield
  except Exception as err:  # pylint: disable=broad-except
    if not is_disk_full(err) or isinstance(err, DiskFullError):
      raise
    raise DiskFullError(f"{folder}: the disk is full (no space left on device); {kept()}. Free "
                        "space, then run the same command to go on.") from None


# One run per workdir ----------------------------------------------------------------------------

LOCK_FILE = ".lock"
_held: dict[str, int] = {}  # lock path -> the open descriptor that holds it (this process's)


class WorkdirError(RuntimeError):
  """A workdir this run cannot use: not makeable here, or held by another run."""


class WorkdirBusyError(WorkdirError):
  """Another live process runs in the workdir (said with its pid, host and start)."""


# The errors of a path that cannot be written, and what to do about each.
_UNWRITABLE = {
    errno.ENOTDIR: "a part of it is a file, not a folder; name a path under a folder",
    errno.EISDIR: "it is a folder where a file is wanted; name a file",
    errno.EROFS: "the filesystem is read-only; name a path on a writable one",
    errno.EACCES: "permission denied; name a folder you can write, or change its permissions",
    errno.EPERM: "not permitted; name a folder you can write",
    errno.EEXIST: "a file of that name is in the way; move it or name another path",
}


def unwritable(err: OSError) -> str | None:
  """One line for an OSError of a path that cannot be made or written (`err.filename` and the
  fix), or None for another kind of error."""
  fix = _UNWRITABLE.get(err.errno)
  if fix is None:
    return None
  where = f"{err.filename}: " if err.filename else ""
  return f"{where}{err.strerror or type(err).__name__} ({fix})."


def lock_workdir(workdir: str) -> str | None:
  """Takes `workdir`'s lock for this process's lifetime; returns a note when it takes over the
  lock of a process that died holding it, else None. Raises WorkdirBusyError while a live process
  holds it.

  An advisory `flock` on `<workdir>/.lock`: the kernel drops it when its process dies however it
  dies, so a stale lock can never block a rerun; the file names the holder for the messages and is
  emptied on a clean exit (left filled, it tells the next run a holder died). Local (and NFS)
  folders only: object stores (gs://) offer no lock, and are left unlocked. The descriptor is not
  inherited by subprocesses (Python's default), so only the run's own process holds it.
  """
  if _is_url(workdir):
    return None
  import atexit  # pylint: disable=import-outside-toplevel
  import fcntl  # pylint: disable=import-outside-toplevel
  import socket  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as err:  # a file in the way, a read-only or foreign folder: said, not traced
    if (said := unwritable(err)) is None:
      raise
    raise WorkdirError(f"--workdir={workdir} cannot be made: {said}") from None
  path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
  if path in _held:
    return None
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
    os.close(fd)
    raise WorkdirBusyError(
        f"--workdir={workdir} is in use by {holder} ({path}): one run per workdir. Wait for that "
        "run to end (or stop it), or choose another --workdir.") from None
  left = os.read(fd, 4096).decode("utf-8", "replace").strip()
  os.lseek(fd, 0, os.SEEK_SET)
  os.ftruncate(fd, 0)
  os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n".encode())
  _held[path] = fd

  def release():
    os.ftruncate(fd, 0)  # a clean end: the next run has nothing to take over
    os.close(fd)
    _held.pop(path, None)
  atexit.register(release)
  if left:
    return f"took over {path} of {left}: that process is no longer running"
  return None
