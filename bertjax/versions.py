"""The package versions a TPU job runs with, against the lock every TPU VM installs.

`launch/requirements-tpu.lock` pins jax, jaxlib, libtpu and the rest exactly. `bertjax.aot`
records the versions it compiled with; on each TPU VM `python -m bertjax.versions` prints its own
(`launch/tpu.py run` collects them from every worker and refuses to start when they differ).
Reads package metadata only: importing jax here would cost seconds on every worker.

    python -m bertjax.versions [LOCK]     # name==version of each package in the lock
"""

from __future__ import annotations

import importlib.metadata
import os
import re

from bertjax.errors import Refusal


LOCK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                    "requirements-tpu.lock")


def canonical(name: str) -> str:
  """PEP 503 names: tensorflow_cpu, TensorFlow-CPU and tensorflow-cpu are one package."""
  return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str = LOCK) -> dict[str, str]:
  """{package: version} of the `name==version` lines of a requirements lock."""
  pins = {}
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.split("#", 1)[0].strip()
      if not line:
        continue
      found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;]+)", line)
      if not found:
        raise Refusal(f"{path}:{number}: {line!r} is not an exact pin (name==version)")
      pins[canonical(found.group(1))] = found.group(2)
  return pins


def installed(names) -> dict[str, str]:
  """{package: installed version, or "missing"} for each name."""
  out = {}
  for name in names:
    try:
      out[canonical(name)] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[canonical(name)] = "missing"
  return out


def differences(have: dict[str, str], want: dict[str, str]) -> list[str]:
  """`name have != want` for each package of `want` whose version differs."""
  return [f"{name} {have.get(name, 'missing')} != {version}"
          for name, version in sorted(want.items()) if have.get(name, "missing") != version]


def format_versions(versions: dict[str, str]) -> str:
  return " ".join(f"{name}=={version}" for name, version in sorted(versions.items()))


def parse_versions(text: str) -> dict[str, str]:
  """The inverse of format_versions."""
  return dict(item.split("==", 1) for item in text.split() if "==" in item)


def main(argv) -> None:
  """`python -m bertjax.versions [LOCK]`: the installed version of each package LOCK pins."""
  if len(argv) > 2:
    from absl import app  # pylint: disable=import-outside-toplevel
    raise app.UsageError(f"one lock file at most (got {argv[1:]})")
  print(format_versions(installed(read_lock(argv[1] if len(argv) > 1 else LOCK))))


if __name__ == "__main__":
  from bertjax import cli
  cli.run(main)
