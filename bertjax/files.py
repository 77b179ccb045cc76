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

from bertjax.errors import DamagedFileError, DiskFullError, WorkdirBusyError, WorkdirError



def _is_url(path: str) -> bool:
  return "://" in path


def gfile():
  """tf.io.gfile (local paths and URLs such as gs://): TensorFlow is loaded at the first call."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.io.gfile


def open_file(path: str, mode: str = "rb"):
  if _is_url(path):
    return gfile().GFile(path, mode)
  return open(path, mode)  # pylint: disable=unspecified-encoding


def exists(path: str) -> bool:
  return gfile().exists(path) if _is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return gfile().isdir(path) if _is_url(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
  if _is_url(path):
    return [name.rstrip("/") for name in gfile().listdir(path)]
  return os.listdir(path)


def makedirs(path: str) -> None:
  if _is_url(path):
    gfile().makedirs(path)
  else:
    os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
  if _is_url(path):
    gfile().remove(path)
  else:
    os.remove(path)


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
    gfile = gfile()
    with gfile.GFile(tmp, "w") as f:
      f.write(text)
    gfile.rename(tmp, path, overwrite=True)
    return
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:  # a full disk, EIO, a stop: the old file stays, no part is left beside it
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_json(path: str, value: Any) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def copy(source: str, target: str) -> None:
  """Copies `source` to `target` atomically (a temporary file beside it, then a rename)."""
  tmp = f"{target}.tmp-{os.getpid()}"
  if _is_url(source) or _is_url(target):
    gfile = gfile()
    gfile.copy(source, tmp, overwrite=True)
    gfile.rename(tmp, target, overwrite=True)
    return
  try:
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)
  except BaseException:  # a full disk, EIO, a stop: no part is left beside the target
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


# A full disk, a failed write -------------------------------------------------------------------

_NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
_IO_ERROR = os.strerror(errno.EIO)  # "Input/output error"
# What each storage fault is, for the one line, and what to do before running again.
STORAGE_FAULTS = {
    errno.ENOSPC: ("the disk is full (no space left on device)", "Free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "Free space or raise the quota"),
    errno.EIO: ("a write failed with an input/output error (EIO: the disk, or the connection to "
                "it, failed)", "Check the disk (dmesg; for a network disk, its mount)"),
}


def storage_fault(err: BaseException | None) -> tuple[int, str | None] | None:
  """(errno, the file if known) when `err`, or an error it was raised from or during, is a write
  that found no space left (ENOSPC, EDQUOT) or failed in the device (EIO): an OSError with that
  errno, or the C libraries' errors that carry its text (tensorstore, which writes orbax's arrays,
  raises a ValueError "RESOURCE_EXHAUSTED: ... No space left on device"; TensorFlow's file writes
  their own error). Orbax raises a failed save again at every later wait, each during the last,
  so the cause can lie several links down the chain. None for anything else."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno in STORAGE_FAULTS:
      return err.errno, err.filename
    text = str(err)
    if _NO_SPACE in text:
      return errno.ENOSPC, None
    if _IO_ERROR in text or "os_error_code='5'" in text:
      return errno.EIO, None
    err = err.__cause__ or err.__context__
  return None


def is_disk_full(err: BaseException | None) -> bool:
  """Whether `err` (or its chain: `storage_fault`) is a write that found no space left."""
  fault = storage_fault(err)
  return fault is not None and fault[0] in (errno.ENOSPC, errno.EDQUOT)


def storage_fault_line(where: str, err: BaseException, kept: str) -> str | None:
  """One line for a storage fault in `err`: `where` (a flag and its path), what failed and on
  which file, `kept` (what is left intact), the fix; None when `err` is no storage fault."""
  fault = storage_fault(err)
  if fault is None:
    return None
  what, fix = STORAGE_FAULTS[fault[0]]
  at = f" at {fault[1]}" if fault[1] else ""
  return f"{where}: {what}{at}; {kept}. {fix}, then run the same command to go on."


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
  """Names `path` in a storage fault met inside, for a write whose error does not (a file's
  write(), safetensors: "No space left on device" and no file): raised again as an OSError of
  that file."""
  try:
    yield
  except Exception as err:  # pylint: disable=broad-except
    if (fault := storage_fault(err)) is None or getattr(err, "filename", None):
      raise
    raise OSError(fault[0], os.strerror(fault[0]), path) from err


@contextlib.contextmanager
def disk_full_said(folder: str, kept: Callable[[], str]) -> Iterator[None]:
  """Turns a full disk or a failed write (`storage_fault`) met inside into one DiskFullError
  naming `folder`, what failed and what is kept (`kept()`, asked then): otherwise orbax's
  background save, failing at each wait, ends a run with a score of chained tracebacks."""
  try:
    yield
  except Exception as err:  # pylint: disable=broad-except
    if isinstance(err, DiskFullError) or (fault := storage_fault(err)) is None:
      raise
    raise DiskFullError(storage_fault_line(folder, err, kept()), fault[0]) from None


# One run per workdir ----------------------------------------------------------------------------

LOCK_FILE = ".lock"
_held: dict[str, int] = {}  # lock path -> the open descriptor that holds it (this process's)


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
