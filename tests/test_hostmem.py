"""Host memory on huge pages: the GLIBC_TUNABLES edit, the hint, the opt-in restart, and the\neffect on faults."""

import os
import subprocess
import sys
import textwrap

import pytest

from bertjax.parallel import hostmem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pylint: disable-next=protected-access
HAS_TUNABLE = sys.platform.startswith("linux") and hostmem._glibc_has_tunable()
needs_glibc = pytest.mark.skipif(not HAS_TUNABLE,
                                 reason="glibc.malloc.hugetlb needs Linux with glibc 2.35 or newer")


def test_the_tunable_is_added_once_and_a_users_choice_is_kept():
  assert hostmem.tunables_with_huge_pages("") == "glibc.malloc.hugetlb=1"
  assert (hostmem.tunables_with_huge_pages("glibc.malloc.arena_max=2")
          == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
  assert hostmem.tunables_with_huge_pages("glibc.malloc.hugetlb=1") is None
  assert hostmem.tunables_with_huge_pages("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0") is None
  # A longer name that starts with the tunable's is another tunable.
  assert (hostmem.tunables_with_huge_pages("glibc.malloc.hugetlbx=1")
          == "glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1")


def test_the_kernels_mode_is_read_from_its_brackets(tmp_path):
  mode = tmp_path / "enabled"
  mode.write_text("always [madvise] never\n")
  assert hostmem.thp_mode(str(mode)) == "madvise"
  mode.write_text("[always] madvise never\n")
  assert hostmem.thp_mode(str(mode)) == "always"
  assert hostmem.thp_mode(str(tmp_path / "absent")) is None


def _run(code: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
  environment = {k: v for k, v in os.environ.items()
                 if k not in ("GLIBC_TUNABLES", hostmem.ENV_RESTARTED)}
  environment.update(env, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment,
                        capture_output=True, text=True, timeout=timeout, check=True)


RESTART = """
    import os
    from bertjax.parallel import hostmem
    with open({log!r}, "a") as f:
      f.write(os.environ.get("GLIBC_TUNABLES", "-") + "\\n")
    hostmem.restart_with_huge_pages({mode!r})
    print("tunables:", os.environ.get("GLIBC_TUNABLES"))
"""


@needs_glibc
@pytest.mark.parametrize("kernel_mode, switch, runs", [
    ("madvise", "restart", ["-", "glibc.malloc.hugetlb=1"]),  # asked: restarted once, with it
    ("madvise", None, ["-"]),  # by default nothing restarts behind the user's back
    ("madvise", "0", ["-"]),
    ("never", "restart", ["-"]),  # a kernel that takes no advice: nothing to gain
    ("always", "restart", ["-"]),  # a kernel that needs none
])
def test_the_process_restarts_itself_only_when_asked_and_where_the_advice_changes_something(
    tmp_path, kernel_mode, switch, runs):
  mode, log = tmp_path / "enabled", tmp_path / "runs"
  modes = ("always", "madvise", "never")
  mode.write_text(" ".join(f"[{m}]" if m == kernel_mode else m for m in modes) + "\n")
  env = {} if switch is None else {"BERTJAX_HUGE_PAGES": switch}
  out = _run(RESTART.format(log=str(log), mode=str(mode)), **env)
  assert log.read_text().split() == runs
  assert out.stdout.strip() == f"tunables: {runs[-1] if runs[-1] != '-' else None}"


def test_the_hint_says_how_to_set_it_where_it_would_help(tmp_path, monkeypatch):
  mode = tmp_path / "enabled"
  mode.write_text("always [madvise] never\n")
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.delenv("BERTJAX_HUGE_PAGES", raising=False)
  hint = hostmem.hint_line(str(mode))
  if HAS_TUNABLE:
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in hint
  else:
    assert hint is None
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  assert hostmem.hint_line(str(mode)) is None  # in effect already
  monkeypatch.delenv("GLIBC_TUNABLES")
  monkeypatch.setenv("BERTJAX_HUGE_PAGES", "0")
  assert hostmem.hint_line(str(mode)) is None
  mode.write_text("[always] madvise never\n")
  monkeypatch.delenv("BERTJAX_HUGE_PAGES")
  assert hostmem.hint_line(str(mode)) is None  # the kernel needs no advice


@needs_glibc
def test_a_restarted_process_never_restarts_again(tmp_path):
  """Even where the tunables it was given read as unset (a glibc that spells them otherwise)."""
  mode, log = tmp_path / "enabled", tmp_path / "runs"
  mode.write_text("always [madvise] never\n")
  code = RESTART.replace("from bertjax.parallel import hostmem", "from bertjax.parallel import hostmem\n"
                         "    hostmem.tunables_with_huge_pages = lambda current: 'x=1'")
  _run(code.format(log=str(log), mode=str(mode)), timeout=60, BERTJAX_HUGE_PAGES="restart")
  assert log.read_text().split() == ["-", "x=1"]


FAULTS = """
    import resource, jax, jax.numpy as jnp
    from bertjax.parallel import hostmem
    hostmem.restart_with_huge_pages()

    @jax.jit
    def f(x, w):
      h = jnp.dot(x, w)  # a 64 MiB temporary buffer, allocated anew by every call
      return jnp.max(h) + jnp.sum(h)

    x, w = jnp.ones((4096, 512)), jnp.ones((512, 4096))
    f(x, w).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
      f(x, w).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


@needs_glibc
@pytest.mark.skipif(hostmem.thp_mode() != "madvise",
                    reason="the kernel's transparent huge pages are not in madvise mode")
def test_a_steps_scratch_memory_faults_in_by_huge_pages():
  """A 64 MiB scratch buffer faults 16,384 times per call on 4 KiB pages; on 2 MiB pages 32 for
  it, a few hundred in all (174 measured here)."""
  small = float(_run(FAULTS).stdout)
  huge = float(_run(FAULTS, BERTJAX_HUGE_PAGES="restart").stdout)
  assert small > 16000, small
  assert huge < small / 10, (huge, small)
