"""The project's refusal: input a command or a function cannot use, said in one line.

`Refusal` is what bertjax raises where it refuses what it was given (a config value, a file, a
folder, a flag): the message names the problem and the fix. A command ends on one with the message
alone (`cli.explained`); any other ValueError is a fault of the code and keeps its traceback. It
is a ValueError, so `except ValueError` (and `pytest.raises(ValueError)`) still catch it.
"""


class Refusal(ValueError):
  """Input bertjax cannot use; the message names the problem and the fix."""
