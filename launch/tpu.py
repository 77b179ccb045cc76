#!/usr/bin/env python3
"""Pre-train on a Cloud TPU slice: create it, set it up, run, follow, stop, delete.

  python launch/tpu.py up --name=bert-large --zone=ZONE --accelerator-type=v5p-128 --spot \\
      --config=configs/bert_large.py --workdir=gs://BUCKET/large_p1 \\
      -- --config.data.cache_dir=gs://BUCKET/bertjax-cache

Subcommands: create (a queued resource, waits until ACTIVE), setup (project + venv + jax[tpu] on
every worker), run (bertjax.main in the background on every worker, a log file per worker), logs
(follow worker 0), stop (SIGTERM: the loop saves a checkpoint and exits), delete, and up (create +
setup + run + logs). Every command is printed before it runs; --dry-run prints them and runs
nothing (no subprocess at all). Flags after `--` go to `python -m bertjax.main` unchanged.
The inputs are checked before anything is created: the accelerator type, a gs:// workdir and
shared data for multi-host jobs, the config's mesh against the slice (ICI) and the slices (DCN).
See launch/README.md for a worked example.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# On every TPU VM (each is its own machine, so one log file per worker).
REMOTE_PROJECT = "$HOME/bertjax"
REMOTE_VENV = "$HOME/bertjax-venv"
REMOTE_LOGS = "$HOME/bertjax-logs"
REMOTE_LOG = f"{REMOTE_LOGS}/train.log"
REMOTE_TARBALL = "bertjax.tar.gz"  # relative to the remote home directory
# Matches the training process's command line from its start (".../python -m bertjax.main ..."),
# never the remote shell whose script text merely contains these words.
TRAINING_PROCESS = "^[^ ]*python[^ ]* -m bertjax[.]main"
REFUSE_IF_RUNNING = (f'if pgrep -f "{TRAINING_PROCESS}" >/dev/null; then echo "$(hostname): training '
                     'is running; stop it first (launch/tpu.py stop)" >&2; exit 1; fi')
FAILED_STATES = ("FAILED", "SUSPENDING", "SUSPENDED")
MESH_AXES = ("data", "fsdp", "tensor")

# Generation -> (default runtime version, what the number in the type counts). Runtime versions:
# https://cloud.google.com/tpu/docs/runtimes ("v4 and earlier" use tpu-ubuntu2204-base).
GENERATIONS = {
    "v4": ("tpu-ubuntu2204-base", "cores"),
    "v5p": ("v2-alpha-tpuv5", "cores"),
    "v5litepod": ("v2-alpha-tpuv5-lite", "chips"),
    "v6e": ("v2-alpha-tpuv6e", "chips"),
}
CHIP_SLICE_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e and v6e slices (chips)


class LaunchError(Exception):
  """Bad input or a failed command: printed as one clear line, exit status non-zero."""


# --- The slice. --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  generation: str
  chips: int
  hosts: int | None  # None: several hosts, how many depends on the VM shape chosen by Cloud TPU

  @property
  def multi_host(self) -> bool:
    return self.hosts is None or self.hosts > 1

  @property
  def runtime_version(self) -> str:
    return GENERATIONS[self.generation][0]

  def describe(self) -> str:
    hosts = "several hosts" if self.hosts is None else (
        f"{self.hosts} host{'s' if self.hosts > 1 else ''}")
    return f"{self.name}: {self.chips} chips (JAX devices), {hosts}"


def parse_accelerator(name: str) -> Accelerator:
  """`v5p-128` -> 64 chips on 16 hosts. Raises LaunchError for a type this launcher does not know."""
  known = ("v4-N and v5p-N (N TensorCores, a multiple of 8: v5p-128 = 64 chips on 16 hosts), "
           f"v5litepod-N and v6e-N (N chips, one of {', '.join(map(str, CHIP_SLICE_SIZES))})")
  m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", name or "")
  if not m:
    hint = (f" (Cloud TPU calls v5e slices v5litepod-N: --accelerator-type="
            f"{name.replace('v5e-', 'v5litepod-')})" if (name or "").startswith("v5e-") else "")
    raise LaunchError(f"Unknown accelerator type {name!r}{hint}; known: {known}")
  generation, size = m.group(1), int(m.group(2))
  if GENERATIONS[generation][1] == "cores":
    if size < 8 or size % 8:
      raise LaunchError(f"Unknown accelerator type {name!r}: {generation} sizes count TensorCores "
                        f"(2 per chip, 4 chips per host), a multiple of 8; known: {known}")
    chips = size // 2
    return Accelerator(name, generation, chips, chips // 4)
  if size not in CHIP_SLICE_SIZES:
    raise LaunchError(f"Unknown accelerator type {name!r}: {generation} sizes count chips, one of "
                      f"{CHIP_SLICE_SIZES}; known: {known}")
  return Accelerator(name, generation, size, 1 if size <= 8 else None)


# --- The config and its overrides (checked here so that a mismatch fails before paying). -------------


def config_overrides(flags: list[str]) -> dict[str, str]:
  """`--config.mesh.dcn_data=2` (or `--config.mesh.dcn_data 2`) -> {"mesh.dcn_data": "2"}."""
  out = {}
  for i, flag in enumerate(flags):
    if not flag.startswith("--config."):
      continue
    key, sep, value = flag[len("--config."):].partition("=")
    if not sep:
      if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
        continue  # a boolean flag (--config.data.nsp): not one this launcher checks
      value = flags[i + 1]
    out[key] = value
  return out


def load_config(spec: str):
  """The ConfigDict of `configs/x.py[:arg]` (its own get_config; configs/base.py imports
  bertjax.sharding for its default rules, so jax is imported too)."""
  path, _, arg = spec.partition(":")
  module_path = os.path.join(REPO, path)
  if REPO not in sys.path:
    sys.path.insert(0, REPO)  # configs/*.py import configs.base
  module_spec = importlib.util.spec_from_file_location("_launch_config", module_path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if arg:
    return module.get_config(arg)
  if inspect.signature(module.get_config).parameters:
    return module.get_config(None)
  return module.get_config()


def relative_config(spec: str) -> str:
  """The config as a path inside the project (the job runs from the project root on each VM)."""
  path, sep, arg = spec.partition(":")
  full = os.path.abspath(path) if os.path.isabs(path) or os.path.exists(path) else os.path.join(
      REPO, path)
  rel = os.path.relpath(full, REPO)
  if rel.startswith(".."):
    raise LaunchError(f"--config={spec}: the config must be inside the project ({REPO}); it is "
                      "shipped to the TPU VMs with it")
  if not os.path.isfile(full):
    raise LaunchError(f"--config={spec}: no such file {full}")
  return rel + sep + arg


def fill(sizes: dict[str, int], total: int, group: str) -> str | None:
  """None if `sizes` (one may be -1) can cover `total` devices or slices, else why not (as sharding.py)."""
  named = ", ".join(f"{group}_{a}={s}" for a, s in sizes.items())
  if sum(s == -1 for s in sizes.values()) > 1:
    return f"at most one {group} size may be -1 ({named})"
  if any(s == 0 or s < -1 for s in sizes.values()):
    return f"{group} sizes must be positive or -1 ({named})"
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    return None if total % known == 0 else (
        f"{named} needs a multiple of {known}, but there are {total}")
  return None if known == total else f"{named} multiplies to {known}, but there are {total}"


def check_mesh(values: dict[str, int], accel: Accelerator | None, num_slices: int) -> list[str]:
  """Problems of the config's mesh on this slice (ICI: devices per slice) and slices (DCN)."""
  problems = []
  dcn = {a: values[f"dcn_{a}"] for a in MESH_AXES if f"dcn_{a}" in values}
  if len(dcn) == len(MESH_AXES):
    why = fill(dcn, num_slices, "dcn")
    if why:
      fix = (f"set --config.mesh.dcn_data={num_slices} (or -1) and the other dcn_* to 1"
             if num_slices > 1 else "set every --config.mesh.dcn_* to 1 (or dcn_data to -1)")
      problems.append(f"the mesh does not fit --num-slices={num_slices}: {why}; {fix}")
  ici = {a: values[f"ici_{a}"] for a in MESH_AXES if f"ici_{a}" in values}
  if accel is not None and len(ici) == len(MESH_AXES):
    why = fill(ici, accel.chips, "ici")
    if why:
      problems.append(f"the mesh does not fit {accel.name} ({accel.chips} devices per slice): {why}")
  return problems


@dataclasses.dataclass
class RunPlan:
  config: str  # relative to the project root
  workdir: str
  flags: list[str]
  warnings: list[str]


def plan_run(config: str, workdir: str, flags: list[str], accel: Accelerator | None,
             num_slices: int) -> RunPlan:
  """Validates a run before anything is created or started; raises LaunchError with the fix."""
  rel = relative_config(config)
  multi_host = num_slices > 1 or accel is None or accel.multi_host
  if accel is None:
    hosts_text = "no --accelerator-type given, so taken as multi-host"
  else:
    hosts_text = (f"{num_slices} slices of " if num_slices > 1 else "") + accel.describe()
  if multi_host and not workdir.startswith("gs://"):
    raise LaunchError(
        f"--workdir={workdir} is not on gs://. Every host of a multi-host job ({hosts_text}) writes "
        "the same checkpoint directory; a local path would be a different folder on each VM, lost "
        "when the slice is deleted. Use e.g. --workdir=gs://BUCKET/run1")
  warnings = []
  overrides = config_overrides(flags)
  try:
    cfg = load_config(rel)
    mesh = {k: int(v) for k, v in cfg.mesh.items() if k != "logical_axis_rules"}
    data = {k: cfg.data[k] for k in ("cache_dir", "prepared_dir", "vocab_path", "num_shards")}
  except Exception as err:  # pylint: disable=broad-except
    warnings.append(f"could not load {rel} here ({type(err).__name__}: {err}); only the "
                    "--config.* flags given are checked")
    mesh, data = {}, {}
  for key, value in overrides.items():
    group, _, name = key.partition(".")
    if group == "mesh" and name != "logical_axis_rules":
      try:
        mesh[name] = int(value)
      except ValueError:
        raise LaunchError(f"--config.{key}={value} is not an integer") from None
    elif group == "data" and name in ("cache_dir", "prepared_dir", "vocab_path"):
      data[name] = value
    elif group == "data" and name == "num_shards" and value.isdigit():
      data[name] = int(value)
  problems = check_mesh(mesh, accel, num_slices)
  if problems:
    raise LaunchError(f"{rel}: " + "; ".join(problems))
  if not all(f"dcn_{a}" in mesh for a in MESH_AXES):
    warnings.append("the config's dcn_* sizes are unknown here: not checked against --num-slices")
  if multi_host:
    shared = str(data.get("cache_dir", "")).startswith("gs://") or (
        str(data.get("prepared_dir", "")).startswith("gs://") and data.get("vocab_path"))
    if "cache_dir" in data and not shared:
      raise LaunchError(
          f"data.cache_dir={data['cache_dir']!r} is local to each VM, but in a multi-host job "
          f"({hosts_text}) process 0 prepares the vocabulary and shards and every other host reads "
          "them. Pass --config.data.cache_dir=gs://BUCKET/bertjax-cache (or "
          "--config.data.prepared_dir=gs://... with --config.data.vocab_path=...)")
    hosts = (accel.hosts or 0) * num_slices if accel else 0
    if hosts and data.get("num_shards") and data["num_shards"] < hosts:
      warnings.append(f"data.num_shards={data['num_shards']} < {hosts} hosts: every host reads "
                      "every shard (works, slower); prepare at least one shard per host")
  return RunPlan(rel, workdir, list(flags), warnings)


def from_setup_py(pattern: str, default: str) -> str:
  """A requirement as setup.py states it: jax's (shown), the lowest Python (the venv's)."""
  try:
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
      m = re.search(pattern, f.read())
  except OSError:
    return default
  return m.group(1) if m else default


JAX_REQUIREMENT = r"""["'](jax[^\[\]"']*)["']"""  # "jax>=0.7,<0.11"
PYTHON_REQUIREMENT = r"python_requires\s*=\s*[\"']>=\s*([0-9.]+)"  # ">=3.11" -> 3.11


# --- Commands. -----------------------------------------------------------------------------------------


class Runner:
  """Prints each command (`+ ...`, copy-pasteable) and runs it unless this is a dry run."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def say(self, text: str) -> None:
    print(f"# {text}", flush=True)

  def run(self, argv: list[str], capture: bool = False, quiet: bool = False) -> str:
    if not quiet:
      print("+ " + shlex.join(argv), flush=True)
    if self.dry_run:
      return ""
    try:
      done = subprocess.run(argv, check=False, text=True,
                            stdout=subprocess.PIPE if capture else None)
    except FileNotFoundError:
      raise LaunchError(f"{argv[0]} not found on PATH" + (
          ": install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)"
          if argv[0] == "gcloud" else "")) from None
    if done.returncode:
      raise LaunchError(f"exit status {done.returncode}: {shlex.join(argv)}")
    return done.stdout or ""


def _location(args) -> list[str]:
  return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def ssh(args, script: str, worker: str = "all") -> list[str]:
  """gcloud ssh running `script` on the workers: of the slice, or of every slice (multi-slice)."""
  if args.num_slices > 1:
    head = ["gcloud", "compute", "tpus", "queued-resources", "ssh", args.name,
            "--node=all" if worker == "all" else "--node=0"]
  else:
    head = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name]
  return head + [f"--worker={worker}"] + _location(args) + [f"--command={script}"]


def scp(args, local: str, remote: str) -> list[str]:
  if args.num_slices > 1:
    head = ["gcloud", "compute", "tpus", "queued-resources", "scp", local, f"{args.name}:{remote}",
            "--node=all"]
  else:
    head = ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{args.name}:{remote}"]
  return head + ["--worker=all"] + _location(args)


def create(args, runner: Runner) -> None:
  accel = parse_accelerator(args.accelerator_type)
  runtime = args.runtime_version or accel.runtime_version
  slices = f"{args.num_slices} slices of " if args.num_slices > 1 else ""
  tier = "spot" if args.spot else "reserved" if args.reserved else "on-demand"
  runner.say(f"create: {slices}{accel.describe()}; runtime {runtime}; {tier}")
  argv = ["gcloud", "compute", "tpus", "queued-resources", "create", args.name]
  if args.num_slices > 1:
    argv += [f"--node-count={args.num_slices}", f"--node-prefix={args.name}"]
  else:
    argv += [f"--node-id={args.name}"]
  argv += [f"--accelerator-type={accel.name}", f"--runtime-version={runtime}"] + _location(args)
  argv += ["--spot"] if args.spot else ["--reserved"] if args.reserved else []
  runner.run(argv)
  describe = (["gcloud", "compute", "tpus", "queued-resources", "describe", args.name]
              + _location(args) + ["--format=value(state.state)"])
  runner.say(f"wait until ACTIVE: repeated every {args.poll_seconds} s (printed once)")
  last, waited = None, 0.0
  while True:
    state = runner.run(describe, capture=True, quiet=last is not None).strip() or "UNKNOWN"
    if runner.dry_run:
      return
    if state != last:
      runner.say(f"{args.name}: {state} after {waited / 60:.0f} min")
      last = state
    if state == "ACTIVE":
      return
    if state in FAILED_STATES:
      raise LaunchError(f"queued resource {args.name} is {state}; see `gcloud compute tpus "
                        f"queued-resources describe {args.name} {' '.join(_location(args))}`, then "
                        "delete it (launch/tpu.py delete) and create again")
    time.sleep(args.poll_seconds)
    waited += args.poll_seconds


def remote_quote(arg: str) -> str:
  """Shell quoting for the remote script: double quotes where they suffice, so that the gcloud
  command around it (single-quoted) stays readable; shlex.quote otherwise."""
  if shlex.quote(arg) == arg:
    return arg
  if not any(c in arg for c in '$`"\\!'):
    return f'"{arg}"'
  return shlex.quote(arg)


def setup_script(args, python_version: str) -> str:
  """Project, venv and packages on one worker; safe to run again (reuses the venv)."""
  uv = "$HOME/.local/bin/uv"
  if args.repo:
    fetch = [f"git clone --quiet {remote_quote(args.repo)} {REMOTE_PROJECT}"]
    if args.ref:
      fetch.append(f"git -C {REMOTE_PROJECT} checkout --quiet {remote_quote(args.ref)}")
  else:
    fetch = [f"mkdir -p {REMOTE_PROJECT}",
             f"tar -xzf $HOME/{REMOTE_TARBALL} -C {REMOTE_PROJECT}"]
  pip = f"{REMOTE_VENV}/bin/python -m pip install --quiet"
  return "\n".join([
      "set -eu",
      REFUSE_IF_RUNNING,
      f"rm -rf {REMOTE_PROJECT}",
      *fetch,
      # TPU VM images ship the Ubuntu 22.04 Python (3.10); uv brings the Python setup.py needs.
      f"test -x {uv} || python3 -m pip install --user --quiet uv"
      " || curl -LsSf https://astral.sh/uv/install.sh | sh",
      f"test -x {REMOTE_VENV}/bin/python || {uv} venv --seed --python {python_version}"
      f" {REMOTE_VENV}",
      f"{pip} --upgrade pip",
      f"{pip} -e {REMOTE_PROJECT}",
      # libtpu comes with jax[tpu], pinned to the jax that setup.py's requirement resolved to.
      f'JAX_VERSION=$({REMOTE_VENV}/bin/python -c "import jax; print(jax.__version__)")',
      f'{pip} "jax[tpu]==$JAX_VERSION"',
      f'echo "$(hostname): bertjax installed with jax[tpu]==$JAX_VERSION in {REMOTE_VENV}"',
  ])


def setup(args, runner: Runner) -> None:
  python_version = args.python or from_setup_py(PYTHON_REQUIREMENT, "3.11")
  source = f"git clone {args.repo}" + (f" @ {args.ref}" if args.ref else "") if args.repo else (
      f"git archive of {args.ref or 'HEAD'} (committed files only)")
  runner.say(f"setup: on every worker: project from {source}, venv with Python {python_version}, "
             f"pip install -e . ({from_setup_py(JAX_REQUIREMENT, 'jax')}), then jax[tpu] of the "
             "same version")
  if not args.repo:
    ref = args.ref or "HEAD"
    tarball = os.path.join(tempfile.gettempdir(), f"bertjax-{args.name}.tar.gz")
    if not runner.dry_run:
      try:
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               check=False, text=True, stdout=subprocess.PIPE).stdout
      except OSError:
        dirty = ""  # no git: the archive below says so
      if dirty.strip():
        runner.say(f"warning: uncommitted changes are not shipped (git archive {ref}):\n"
                   + dirty.rstrip())
    runner.run(["git", "-C", os.path.relpath(REPO), "archive", "--format=tar.gz",
                f"--output={tarball}", ref])
    runner.run(scp(args, tarball, REMOTE_TARBALL))
  runner.run(ssh(args, setup_script(args, python_version)))


def run_script(plan: RunPlan) -> str:
  """Starts bertjax.main detached (setsid + nohup): a dropped ssh connection does not stop it."""
  job = " ".join(remote_quote(a) for a in
                 [f"--config={plan.config}", f"--workdir={plan.workdir}", *plan.flags])
  return "\n".join([
      "set -eu",
      REFUSE_IF_RUNNING,
      f"mkdir -p {REMOTE_LOGS}",
      f"cd {REMOTE_PROJECT}",
      f'echo "=== $(date -u +%FT%TZ) start" >> {REMOTE_LOG}',
      f"setsid nohup {REMOTE_VENV}/bin/python -m bertjax.main {job} >> {REMOTE_LOG} 2>&1"
      " < /dev/null &",
      f'echo "$(hostname): started (pid $!), log {REMOTE_LOG}"',
  ])


def run(args, runner: Runner, plan: RunPlan | None = None) -> None:
  plan = plan or plan_from_args(args)
  where = f"every worker of {args.num_slices} slices" if args.num_slices > 1 else "every worker"
  runner.say(f"run: on {where}, python -m bertjax.main in the background, log {REMOTE_LOG}"
             + ("; the multi-slice coordinator and slice ids come from the queued resource's "
                "TPU metadata (read by jax.distributed)" if args.num_slices > 1 else ""))
  runner.run(ssh(args, run_script(plan)))


def logs(args, runner: Runner) -> None:
  runner.say(f"logs: worker 0's {REMOTE_LOG} (Ctrl-C stops following; the job goes on)")
  runner.run(ssh(args, f"tail -n 200 -F {REMOTE_LOG}", worker="0"))


def stop_script(wait_seconds: int) -> str:
  return "\n".join([
      f'if pkill -TERM -f "{TRAINING_PROCESS}"; then',
      f'  for i in $(seq {wait_seconds}); do pgrep -f "{TRAINING_PROCESS}" >/dev/null || '
      '{ echo "$(hostname): saved and exited"; exit 0; }; sleep 1; done',
      f'  echo "$(hostname): still running after {wait_seconds} s" >&2; exit 1',
      'else echo "$(hostname): no training process"; fi',
  ])


def kill_script() -> str:
  return (f'pkill -KILL -f "{TRAINING_PROCESS}" && echo "$(hostname): killed" || '
          'echo "$(hostname): no training process"')


def stop(args, runner: Runner) -> None:
  if args.kill:
    runner.say("stop --kill: SIGKILL to the training process on every worker (no checkpoint)")
    runner.run(ssh(args, kill_script()))
    return
  runner.say("stop: SIGTERM to the training process on every worker; it saves a checkpoint at "
             "its next logging step and exits")
  runner.run(ssh(args, stop_script(args.wait_seconds)))


def delete_argv(args) -> list[str]:
  return (["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, "--force",
           "--quiet"] + _location(args))


def delete(args, runner: Runner) -> None:
  runner.say(f"delete: the queued resource {args.name} and its TPU VMs (the gs:// workdir stays)")
  runner.run(delete_argv(args))


def plan_from_args(args) -> RunPlan:
  accel = parse_accelerator(args.accelerator_type) if args.accelerator_type else None
  plan = plan_run(args.config, args.workdir, args.flags, accel, args.num_slices)
  for warning in plan.warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  return plan


def up(args, runner: Runner) -> None:
  plan = plan_from_args(args)  # every input checked before a slice is paid for
  create(args, runner)
  setup(args, runner)
  run(args, runner, plan)
  me = f"python {os.path.relpath(os.path.abspath(__file__))}"
  common = f"--name={args.name} --zone={args.zone}" + (
      f" --project={args.project}" if args.project else "") + (
          f" --num-slices={args.num_slices}" if args.num_slices > 1 else "")
  runner.say(f"later: `{me} logs {common}`; `{me} stop {common}` (saves a checkpoint); when "
             f"finished or preempted, delete the slice (the gs:// workdir stays):")
  print("  " + shlex.join(delete_argv(args)), flush=True)
  logs(args, runner)


# --- Command line. ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--name", required=True, help="queued resource (and TPU node) name")
  common.add_argument("--zone", required=True, help="e.g. us-east5-a (where the quota is)")
  common.add_argument("--project", help="Google Cloud project (default: gcloud's)")
  common.add_argument("--num-slices", type=int, default=1,
                      help="slices of a multi-slice job (queued resource nodes; default 1)")
  common.add_argument("--dry-run", action="store_true",
                      help="print every command, run none (no subprocess at all)")
  slice_ = argparse.ArgumentParser(add_help=False)
  slice_.add_argument("--accelerator-type", required=True, help="v5p-128, v5litepod-64, v6e-256, v4-32")
  slice_.add_argument("--runtime-version", help="default: the one for the generation "
                      f"({', '.join(f'{g}: {r}' for g, (r, _) in GENERATIONS.items())})")
  tier = slice_.add_mutually_exclusive_group()
  tier.add_argument("--spot", action="store_true", help="Spot VMs: cheaper, preemptible")
  tier.add_argument("--reserved", action="store_true", help="the project's reserved capacity")
  slice_.add_argument("--poll-seconds", type=int, default=30, help="describe every N s until ACTIVE")
  project = argparse.ArgumentParser(add_help=False)
  project.add_argument("--repo", help="git URL cloned on each worker (default: a git archive of "
                       "this checkout, copied with scp)")
  project.add_argument("--ref", help="commit, branch or tag (default: HEAD / the default branch)")
  project.add_argument("--python", help="Python for the venv (default: setup.py's python_requires)")
  job = argparse.ArgumentParser(add_help=False)
  job.add_argument("--config", required=True, help="e.g. configs/bert_large.py or ...:phase=2")
  job.add_argument("--workdir", required=True,
                   help="gs://BUCKET/RUN: checkpoints, logs, metrics; the same one resumes")

  p = argparse.ArgumentParser(
      prog="launch/tpu.py", description=__doc__.split("\n\n")[0],
      epilog="Flags after `--` go to python -m bertjax.main (e.g. -- --config.data.cache_dir=gs://B/c).")
  sub = p.add_subparsers(dest="command", required=True)

  def add(name, parents, text):
    return sub.add_parser(name, parents=parents, help=text, description=text)

  add("create", [common, slice_], "request the slice (a queued resource) and wait until ACTIVE")
  add("setup", [common, project], "project, venv, bertjax and jax[tpu] on every worker")
  r = add("run", [common, job], "start python -m bertjax.main on every worker, in the background "
          "(nohup: a dropped ssh does not stop it), with a log file on each worker")
  r.add_argument("--accelerator-type", help="the slice's type, for the checks (without it the "
                 "slice is taken as multi-host)")
  add("logs", [common], "follow worker 0's log")
  s = add("stop", [common], "SIGTERM to the job on every worker (pkill -f of bertjax.main): the "
          "loop saves a checkpoint at its next logging step and exits; `run` with the same "
          "--workdir resumes")
  s.add_argument("--wait-seconds", type=int, default=600, help="wait this long for the save")
  s.add_argument("--kill", action="store_true", help="SIGKILL instead, no checkpoint: for a job "
                 "that SIGTERM cannot stop (e.g. hosts blocked in a collective after one failed)")
  add("delete", [common], "delete the queued resource and its TPU VMs (--force --quiet); the "
      "gs:// workdir stays")
  add("up", [common, slice_, project, job], "create + setup + run + logs; every input is checked "
      "before anything is created")
  return p


COMMANDS = {"create": create, "setup": setup, "run": run, "logs": logs, "stop": stop,
            "delete": delete, "up": up}


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  flags = []
  if "--" in argv:
    i = argv.index("--")
    argv, flags = argv[:i], argv[i + 1:]
  p = parser()
  args = p.parse_args(argv)
  if flags and args.command not in ("run", "up"):
    p.error(f"flags after -- are for bertjax.main; `{args.command}` takes none")
  if args.num_slices < 1:
    p.error(f"--num-slices={args.num_slices} must be at least 1")
  args.flags = flags
  runner = Runner(args.dry_run)
  if args.dry_run:
    runner.say("dry run: the commands are printed, none is run")
  try:
    COMMANDS[args.command](args, runner)
  except LaunchError as err:
    print(f"launch/tpu.py {args.command}: error: {err}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("\ninterrupted (a queued resource that was requested stays requested: "
          "launch/tpu.py delete removes it)", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
