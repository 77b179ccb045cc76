"""The project's errors that more than one module raises or catches, defined once here so that a
module catching one imports it from where it is defined, not from the module that raises it.

`Refusal` is what bertjax raises where it refuses what it was given (a config value, a file, a
folder, a flag): the message names the problem and the fix. A command ends on one with the message
alone (`cli.explained`); any other ValueError is a fault of the code and keeps its traceback. It
is a ValueError, so `except ValueError` (and `pytest.raises(ValueError)`) still catch it.
"""

import errno


class Refusal(ValueError):
  """Input bertjax cannot use; the message names the problem and the fix."""


class DamagedFileError(Refusal):
  """A file bertjax wrote is cut short or not what it should hold (said with the file's path)."""


class CheckpointMismatchError(Refusal):
  """The checkpoint was written by another model, optimizer or vocabulary than the config's."""


class CheckpointDamagedError(Refusal):
  """A checkpoint's files are missing, cut short or unparsable (said with the step and the fix)."""


class NonFiniteError(RuntimeError):
  """A loss or the gradient norm became NaN or Inf; nothing of that state was saved
  (bertjax/training/control.py raises it)."""


class DiskFullError(OSError):
  """A write found no space left (errno ENOSPC) or failed (EIO), said in one line naming the
  folder, what failed and what is kept."""

  def __init__(self, message: str, code: int = errno.ENOSPC):
    super().__init__(message)
    self.errno = code


class WorkdirError(RuntimeError):
  """A workdir this run cannot use: not makeable here, or held by another run."""


class WorkdirBusyError(WorkdirError):
  """Another live process runs in the workdir (said with its pid, host and start)."""
