"""Host memory for steps that run on the CPU: XLA's large buffers on transparent huge pages.

XLA's CPU runtime allocates each step's scratch buffer with malloc (795 MB for the 4-layer,
256-wide model at batch 32 and length 128), and glibc serves an allocation that large with a fresh
anonymous mapping, unmapped again when the step ends. The kernel then fills the mapping one 4 KiB
page at a time: about 208,000 page faults per step there, each zeroing its page. glibc's tunable
`glibc.malloc.hugetlb=1` makes malloc advise the kernel to back areas of 2 MiB and more with huge
pages, which matters where transparent huge pages are in "madvise" mode (a common default). The
step then faults under a thousand times instead, its peak memory unchanged.

glibc reads its tunables once, when the process starts, so the setting belongs to whoever starts
it: `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python -m bertjax.pretrain ...` (the Makefile's targets and
launch/local.sh set it). Nothing restarts a process behind its user's back: an entry point only
says once, on a CPU run where the setting would help and is missing, how to set it
(`hint_line`). `BERTJAX_HUGE_PAGES=restart` opts into the old convenience: the entry point then
re-executes itself (same interpreter, same command line, same PID) with the tunable added
(`restart_with_huge_pages`).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import sys

ENV_SWITCH = "BERTJAX_HUGE_PAGES"
# Set in the restarted process: it never restarts twice, whatever GLIBC_TUNABLES then reads.
ENV_RESTARTED = "BERTJAX_HUGE_PAGES_RESTARTED"
TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
  """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
  try:
    with open(path, encoding="ascii") as f:
      found = re.search(r"\[(\w+)\]", f.read())
  except OSError:
    return None
  return found.group(1) if found else None


def _glibc_has_tunable() -> bool:
  name, version = platform.libc_ver()
  if name != "glibc":
    return False
  try:
    return tuple(int(v) for v in version.split(".")[:2]) >= _MIN_GLIBC
  except ValueError:
    return False


def _setting(tunables: str) -> str | None:
  """The value GLIBC_TUNABLES-style `tunables` give the huge page tunable, None if unnamed."""
  for item in tunables.split(":"):
    name, _, value = item.partition("=")
    if name == TUNABLE:
      return value
  return None


def tunables_with_huge_pages(current: str) -> str | None:
  """GLIBC_TUNABLES with huge pages added; None where `current` already says (either way)."""
  if _setting(current) is not None:
    return None
  return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def huge_pages_in_use() -> bool:
  """Whether this process runs with glibc's huge page advice (for benchmark tables)."""
  return _setting(os.environ.get("GLIBC_TUNABLES", "")) == "1"


def _would_help(mode_file: str) -> str | None:
  """GLIBC_TUNABLES with the advice added, where it would change something: Linux with glibc 2.35
  or newer, the kernel in "madvise" mode ("always" needs no advice, "never" takes none), and the
  tunable not named yet. None elsewhere."""
  if not sys.platform.startswith("linux") or not _glibc_has_tunable():
    return None
  if thp_mode(mode_file) != "madvise":
    return None
  return tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""))


def hint_line(mode_file: str = THP_MODE_FILE) -> str | None:
  """One line telling how to put XLA's CPU scratch on huge pages, where it would help; None
  where it is in effect, would change nothing, or BERTJAX_HUGE_PAGES=0 asks for silence."""
  if os.environ.get(ENV_SWITCH) == "0" or _would_help(mode_file) is None:
    return None
  return (f"host memory on 4 KiB pages: XLA's CPU steps run ~20% faster with huge pages; start "
          f"the command with GLIBC_TUNABLES={TUNABLE}=1 (as the Makefile does), or set "
          f"{ENV_SWITCH}=restart to have it restart itself so, or {ENV_SWITCH}=0 to silence this")


def restart_with_huge_pages(mode_file: str = THP_MODE_FILE) -> None:
  """With BERTJAX_HUGE_PAGES=restart (opt-in), re-executes this process with glibc's huge page
  advice where that changes anything (`_would_help`); otherwise, and in the restarted process,
  returns doing nothing. Call it before the process starts work it would lose: it does not
  return when it restarts.
  """
  if os.environ.get(ENV_SWITCH) != "restart" or ENV_RESTARTED in os.environ:
    return
  tunables = _would_help(mode_file)
  if tunables is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, "GLIBC_TUNABLES": tunables, ENV_RESTARTED: "1"})
  except OSError as error:
    logging.warning("Could not restart with %s=1 (%s); running on 4 KiB pages.", TUNABLE, error)
