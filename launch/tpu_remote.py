"""The shell scripts launch/tpu.py runs on every TPU VM, and the reading of what they print.

Each script is one `--command` of `gcloud compute tpus queued-resources ssh --worker=all`; what a
worker reports for the launcher to read starts with a marker and its hostname
(`bertjax-worker HOST STATE`, `bertjax-versions HOST name==version ...`), and its log lines are
prefixed with `HOST| `, because gcloud interleaves the workers' output without saying whose.
"""

from __future__ import annotations

import dataclasses
import shlex

# On every TPU VM (each is its own machine, so one log file per worker).
REMOTE_PROJECT = "$HOME/bertjax"
REMOTE_VENV = "$HOME/bertjax-venv"
REMOTE_LOGS = "$HOME/bertjax-logs"
REMOTE_LOG = f"{REMOTE_LOGS}/train.log"
REMOTE_PID = f"{REMOTE_LOGS}/train.pid"  # the job's wrapper: lives as long as the job
REMOTE_EXIT = f"{REMOTE_LOGS}/train.exit"  # the job's exit status, written by the wrapper
REMOTE_TARBALL = "bertjax.tar.gz"  # relative to the remote home directory
LOCK = "launch/requirements-tpu.lock"  # relative to the project
# Matches the training process's command line from its start (".../python -m bertjax.pretrain ..."),
# never the remote shell whose script text merely contains these words, nor the job's wrapper
# (`bash -c ... python -m bertjax.pretrain`), which ends when the job does. `bertjax.main`, the
# command's name before, too: a job started under it is found, stopped and refused alike.
TRAINING_PROCESS = "^[^ ]*python[^ ]* -m bertjax[.](pretrain|main)"
REFUSE_IF_RUNNING = (f'if pgrep -f "{TRAINING_PROCESS}" >/dev/null; then echo "$(hostname): training '
                     'is running; stop it first (python -m launch.tpu stop)" >&2; exit 1; fi')
# What holds a TPU: /dev/accel* on v4 and v5p, /dev/vfio/N on v5e and v6e; libtpu's lock file.
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*")
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
WORKER = "bertjax-worker"
VERSIONS = "bertjax-versions"


def remote_quote(arg: str) -> str:
  """Shell quoting for the remote script: double quotes where they suffice, so that the gcloud
  command around it (single-quoted) stays readable; shlex.quote otherwise."""
  if shlex.quote(arg) == arg:
    return arg
  if not any(c in arg for c in '$`"\\!'):
    return f'"{arg}"'
  return shlex.quote(arg)


def setup_script(repo: str | None, ref: str | None, python_version: str) -> str:
  """Project, venv and the locked packages on one worker; safe to run again (reuses the venv)."""
  uv = "$HOME/.local/bin/uv"
  if repo:
    fetch = [f"git clone --quiet {remote_quote(repo)} {REMOTE_PROJECT}"]
    if ref:
      fetch.append(f"git -C {REMOTE_PROJECT} checkout --quiet {remote_quote(ref)}")
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
      # The exact versions of the lock, the same on every worker and in bertjax.aot here.
      f'{pip} -r {REMOTE_PROJECT}/{LOCK} -e "{REMOTE_PROJECT}[tpu]"',
      f'echo "$(hostname): installed {LOCK}: '
      f'$(cd {REMOTE_PROJECT} && {REMOTE_VENV}/bin/python -m bertjax.versions)"',
  ])


def preflight_script(clean: bool = True, devices=TPU_DEVICES, lockfile=LIBTPU_LOCKFILE) -> str:
  """Before a run, on each worker: refuse if the job runs; stop whatever else holds the TPU and
  remove a stale libtpu lock file (a process left from an earlier session keeps the chips
  busy and the new job fails to open them); print the installed versions of the lock."""
  lines = ["set -eu", "H=$(hostname)", REFUSE_IF_RUNNING]
  if clean:
    names = " -o ".join(f'-lname "{d}"' for d in devices)
    lines += [
        # Other users' processes need root to be seen; TPU VMs give sudo without a password.
        'SUDO=; if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi',
        f"HOLDERS=$($SUDO find /proc/[0-9]*/fd -maxdepth 1 \\( {names} \\) 2>/dev/null"
        " | cut -d/ -f3 | sort -u || true)",
        'for P in $HOLDERS; do',
        '  echo "$H: pre-flight: stopping PID $P, which holds the TPU: $(ps -o args= -p $P | '
        'cut -c1-120)"',
        "  $SUDO kill -9 $P || true",
        "done",
        f'if [ -e {lockfile} ]; then $SUDO rm -f {lockfile} && echo "$H: pre-flight: removed '
        f'a stale {lockfile}"; fi',
    ]
  lines.append(f'echo "{VERSIONS} $H $(cd {REMOTE_PROJECT} && {REMOTE_VENV}/bin/python -m '
               f'bertjax.versions {LOCK})"')
  return "\n".join(lines)


@dataclasses.dataclass
class RunPlan:
  config: str  # relative to the project root
  workdir: str
  flags: list[str]
  warnings: list[str]


def logs_dir(workdir: str) -> str:
  return workdir.rstrip("/") + "/logs"


def run_script(plan: RunPlan, sync_every: float = 60) -> str:
  """Starts bertjax.pretrain detached (setsid + nohup: a dropped ssh connection does not stop it),
  in a wrapper that records its exit status, and a copier of its log into WORKDIR/logs."""
  job = " ".join(remote_quote(a) for a in
                 [f"--config={plan.config}", f"--workdir={plan.workdir}", *plan.flags])
  dest = f'{remote_quote(logs_dir(plan.workdir))}/"$(hostname)".log'
  lines = [
      "set -eu",
      REFUSE_IF_RUNNING,
      f"mkdir -p {REMOTE_LOGS}",
      f"cd {REMOTE_PROJECT}",
      f"rm -f {REMOTE_EXIT}",
      f'echo "=== $(date -u +%FT%TZ) start" >> {REMOTE_LOG}',
      # "$@" is the job's argv, so its quoting is the one above; $? is its exit status.
      f'setsid nohup bash -c "\\"\\$@\\" >> {REMOTE_LOG} 2>&1; echo \\$? > {REMOTE_EXIT}" '
      f"bertjax-job {REMOTE_VENV}/bin/python -m bertjax.pretrain {job} < /dev/null > /dev/null 2>&1 &",
      "PID=$!",
      f"echo $PID > {REMOTE_PID}",
  ]
  where = f"log {REMOTE_LOG}"
  if sync_every > 0:  # -m from the project's folder (the `cd` above)
    lines.append(f"setsid nohup {REMOTE_VENV}/bin/python -m launch.logsync "
                 f"--src={REMOTE_LOG} --dest={dest} --pid=$PID --every={sync_every:g} "
                 f">> {REMOTE_LOGS}/logsync.log 2>&1 < /dev/null &")
    where += f", copied to {dest}"
  lines.append(f'echo "$(hostname): started (pid $PID), {where}"')
  return "\n".join(lines)


def check_script(lines: int = 20) -> str:
  """Each worker's state (running, exited:STATUS, vanished, not-started) and its log's end."""
  return "\n".join([
      "H=$(hostname)",
      f"PID=$(cat {REMOTE_PID} 2>/dev/null || true)",
      'if [ -z "$PID" ]; then S=not-started',
      'elif ps -o args= -p "$PID" 2>/dev/null | grep -qE "bertjax[.](pretrain|main)"; then S=running',
      f'elif [ -f {REMOTE_EXIT} ]; then S="exited:$(cat {REMOTE_EXIT})"',
      "else S=vanished; fi",
      f'echo "{WORKER} $H $S"',
      f'if [ -f {REMOTE_LOG} ]; then tail -n {lines} {REMOTE_LOG} | sed "s/^/$H| /"; fi',
  ])


def follow_script(all_workers: bool) -> str:
  if all_workers:  # every worker's lines, each with its host, as they come
    return f'tail -n 50 -F {REMOTE_LOG} | sed -u "s/^/$(hostname)| /"'
  return f"tail -n 200 -F {REMOTE_LOG}"


def collect_script(workdir: str) -> str:
  """One copy of each worker's log into WORKDIR/logs (before its VM goes)."""
  dest = f'{remote_quote(logs_dir(workdir))}/"$(hostname)".log'
  return (f"cd {REMOTE_PROJECT} && {REMOTE_VENV}/bin/python -m launch.logsync --once "
          f"--src={REMOTE_LOG} --dest={dest} && echo \"$(hostname): log copied to {dest}\"")


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


# --- Reading what the workers print. -------------------------------------------------------------


@dataclasses.dataclass
class Worker:
  host: str
  state: str  # running, exited:STATUS, vanished, not-started
  tail: list[str]  # the last lines of its log

  @property
  def alive(self) -> bool:
    return self.state == "running"

  @property
  def finished(self) -> bool:
    return self.state == "exited:0"


def parse_workers(text: str) -> dict[str, Worker]:
  """check_script's output of every worker, by host."""
  workers: dict[str, Worker] = {}
  for line in text.splitlines():
    if line.startswith(WORKER + " "):
      _, host, state = (line.split(" ", 2) + [""])[:3]
      workers[host] = Worker(host, state.strip() or "unknown", [])
  for line in text.splitlines():
    host, sep, rest = line.partition("| ")
    if sep and host in workers:
      workers[host].tail.append(rest)
  return workers


def parse_host_versions(text: str) -> dict[str, dict[str, str]]:
  """preflight_script's version lines: host -> {package: version}."""
  out = {}
  for line in text.splitlines():
    if line.startswith(VERSIONS + " "):
      parts = line.split()
      out[parts[1]] = dict(p.split("==", 1) for p in parts[2:] if "==" in p)
  return out


def _hosts(hosts: list[str]) -> str:
  return ", ".join(hosts) if len(hosts) <= 3 else f"{len(hosts)} workers ({hosts[0]}, ...)"


def version_problems(per_host: dict[str, dict[str, str]], lock: dict[str, str],
                     compiled: dict[str, str] | None = None) -> list[str]:
  """Why the workers may not start: they differ from each other, from the lock, or from what
  bertjax.aot compiled with; one phrase per package, naming the hosts."""
  problems = []
  names = sorted(set().union(*per_host.values()) | set(lock) | set(compiled or {}))
  for name in names:
    by_version: dict[str, list[str]] = {}
    for host, found in sorted(per_host.items()):
      by_version.setdefault(found.get(name, "missing"), []).append(host)
    if len(by_version) > 1:
      problems.append(f"the workers run different {name}: " + ", ".join(
          f"{version} on {_hosts(hosts)}" for version, hosts in by_version.items()))
    for reference, want in (("the lock", lock), ("bertjax.aot's report", compiled or {})):
      if name not in want:
        continue
      for version, hosts in by_version.items():
        if version != want[name]:
          problems.append(f"{name} {version} != {want[name]} of {reference} on {_hosts(hosts)}")
  return problems
