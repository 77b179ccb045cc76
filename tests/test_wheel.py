"""A wheel built from the repository is the whole product: installed in a fresh virtual environment
outside the checkout, it pre-trains and fine-tunes on released configs named by name (the configs
ship inside the package as bertjax.configs; setup.py, bertjax/cli.py).

Offline: the wheel is installed without its dependencies, which the new environment finds in this
environment's site-packages (a .pth line), so nothing is downloaded; the checkout is in neither
the working directory nor PYTHONPATH, so nothing but the wheel can provide bertjax.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

from conftest import xla_flags
from test_data_fixtures import data_section
from test_launch_local import DATA_KEYS
from test_launch_local_finetune import _pair_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout_files() -> list[str]:
  """The repository's files as a clone has them (tracked, or new and not ignored)."""
  out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]


def _build_wheel(tmp_path) -> str:
  src = tmp_path / "src"
  for f in _checkout_files():
    os.makedirs(src / os.path.dirname(f), exist_ok=True)
    shutil.copy2(os.path.join(ROOT, f), src / f)
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  (wheel,) = (tmp_path / "dist").glob("bertjax-*.whl")
  return str(wheel)


def test_a_wheel_pretrains_and_finetunes_released_configs_outside_the_checkout(tmp_path):
  wheel = _build_wheel(tmp_path)
  names = zipfile.ZipFile(wheel).namelist()
  for config in ("tiny", "base", "bert_base", "finetune"):
    assert f"bertjax/configs/{config}.py" in names, names

  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
  python = str(venv / "bin" / "python")
  here = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  # This environment's pip installs the wheel into the new one's prefix (no pip of its own needed).
  done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                         "--ignore-installed", f"--prefix={venv}", wheel],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  # The dependencies: this environment's packages, seen by the new one (not its .pth files, so
  # not this checkout's editable install of bertjax).
  with open(os.path.join(here, "deps.pth"), "w", encoding="utf-8") as f:
    f.write("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")

  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), TF_CPP_MIN_LOG_LEVEL="2", BERTJAX_HUGE_PAGES="0")

  def run(*args):
    done = subprocess.run([python, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout + done.stderr

  where = run("-c", "import bertjax, bertjax.configs.tiny as t; print(bertjax.__file__, t.__file__)")
  assert where.count(str(venv)) == 2 and ROOT not in where, where

  data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  small = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
           "--config.model.num_layers=1", "--config.model.num_heads=2"]
  # The README's command as it stands (configs/tiny.py is no file here: the released one runs).
  run("-m", "bertjax.pretrain", "--config=configs/tiny.py", f"--workdir={tmp_path / 'pre'}",
      *[f"--config.data.{k}={data[k]}" for k in DATA_KEYS], *small,
      "--config.train.num_train_steps=3", "--config.train.warmup_steps=1",
      "--config.train.eval_sequences=8", "--config.checkpoint.save_every_steps=3")
  assert os.path.isdir(tmp_path / "pre" / "checkpoints" / "3")

  _pair_task(tmp_path / "task", n_train=32, n_dev=16)
  said = run("-m", "bertjax.finetune", "--config=finetune:next", f"--workdir={tmp_path / 'ft'}",
             f"--config.checkpoint.init_from={tmp_path / 'pre'}",
             f"--config.data.data_dir={tmp_path / 'task'}",
             "--config.data.max_seq_length=32", "--config.train.batch_size=8",
             "--config.train.num_epochs=1")
  results = json.loads((tmp_path / "ft" / "results.json").read_text())
  assert results["evaluations"] and "accuracy" in results["evaluations"][-1]["scores"], said
