"""launch.tpu against a fake gcloud: checking the workers, versions, the remembered settings,
waiting, preemption under --watch, log collection, and flags passed through; and the pre-flight
and the collection of a log on this machine.

The fake answers `describe` from a queue of states, the workers' check and version reports from
queues of texts, and records every call's argv (tests assert the sequence).
"""

import contextlib
import io
import json
import os
import pathlib
import runpy
import shlex
import subprocess
import sys
import time
from unittest import mock

from packaging.requirements import Requirement
import pytest
import setuptools

from bertjax import versions
from launch import tpu, tpu_remote

REPO = pathlib.Path(__file__).resolve().parent.parent
SLICE = ["--name=pod", "--zone=us-east5-a", "--project=p"]
JOB = ["--config=configs/tiny.py", "--workdir=gs://b/run", "--check-after=0", "--",
       "--config.data.cache_dir=gs://b/cache"]
FAST = ["--poll-seconds=0"]
LOCKED = versions.format_versions(versions.read_lock())

FAKE = """#!{python}
import json, pathlib, sys
d = pathlib.Path({folder!r})
argv = sys.argv[1:]
with open(d / "calls.jsonl", "a") as f:
  f.write(json.dumps(argv) + "\\n")
scenario = json.loads((d / "scenario.json").read_text())
def pop(key):  # the next answer; the last one repeats
  queue = scenario[key]
  answer = queue.pop(0) if len(queue) > 1 else queue[0]
  (d / "scenario.json").write_text(json.dumps(scenario))
  return answer
joined = " ".join(argv)
if any(word in joined for word in scenario.get("fail_on", [])):
  print("ERROR: (gcloud) failed as the test asked", file=sys.stderr)
  sys.exit(3)
if argv[:4] == ["compute", "tpus", "queued-resources", "describe"]:
  state = pop("describe")
  if state in ("NOT_FOUND", "ERROR"):
    print(f"ERROR: (gcloud.compute.tpus.queued-resources.describe) {{state}}: "
          + ("Resource not found" if state == "NOT_FOUND" else "Unavailable"), file=sys.stderr)
    sys.exit(1)
  print(state if state.startswith("{{") else json.dumps({{"state": {{"state": state}}}}))
elif argv[:4] == ["compute", "tpus", "queued-resources", "ssh"]:
  command = [a for a in argv if a.startswith("--command=")][0]
  if "bertjax-versions" in command:
    print(pop("versions"))
  elif "bertjax-worker" in command:
    print(pop("check"))
"""


def workers(**states):
  """A check report: host -> state, e.g. workers(w0="running", w1="exited:1")."""
  return "\n".join(f"bertjax-worker {h} {s}\n{h}| last line of {h} ({s})"
                   for h, s in states.items())


def host_versions(*hosts, **override):
  pins = {**versions.read_lock(), **override}
  return "\n".join(f"bertjax-versions {h} {versions.format_versions(pins)}" for h in hosts)


class Fake:
  def __init__(self, folder: pathlib.Path, **scenario):
    folder.mkdir(parents=True, exist_ok=True)
    self.folder = folder
    scenario.setdefault("describe", ["ACTIVE"])
    scenario.setdefault("check", [workers(w0="running", w1="running")])
    scenario.setdefault("versions", [host_versions("w0", "w1")])
    (folder / "scenario.json").write_text(json.dumps(scenario))
    (folder / "bin").mkdir(exist_ok=True)
    gcloud = folder / "bin" / "gcloud"
    gcloud.write_text(FAKE.format(python=sys.executable, folder=str(folder)))
    gcloud.chmod(0o755)
    self.env = {**os.environ, "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}",
                "BERTJAX_TPU_STATE": str(folder / "state")}

  def launch(self, *args):
    """launch.tpu's main in this process (fast: jax is loaded already), with the fake first
    on PATH; its output captured."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in ("PATH", "BERTJAX_TPU_STATE")}
    os.environ.update({k: self.env[k] for k in saved})
    try:
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tpu.main(list(args))
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

  @property
  def calls(self) -> list[list[str]]:
    path = self.folder / "calls.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []

  def verbs(self) -> list[str]:
    """Each call as `create`, `describe`, `delete`, `scp`, or `ssh:WHAT` (what the script does)."""
    out = []
    for argv in self.calls:
      verb = argv[3]
      if verb == "ssh":
        script = [a for a in argv if a.startswith("--command=")][0]
        verb += ":" + next(what for marker, what in (
            ("bertjax-versions", "preflight"), ("bertjax-job", "run"), ("bertjax-worker", "check"),
            ("uv venv", "setup"), ("launch.logsync --once", "collect"), ("tail -n", "logs"),
            ("pkill -TERM", "stop"), ("pkill -KILL", "kill")) if marker in script)
      out.append(verb)
    return out

  def state(self, name="pod"):
    return json.loads((self.folder / "state" / f"{name}.json").read_text())


def test_run_names_a_worker_that_dies_after_start(tmp_path):
  fake = Fake(tmp_path, check=[workers(w0="running", w1="exited:1")])
  started = time.monotonic()
  r = fake.launch("run", *SLICE, "--accelerator-type=v5p-16", *JOB[:2], "--check-after=0.5",
                  *JOB[3:])
  assert time.monotonic() - started >= 0.5  # it waited before checking
  assert r.returncode == 1
  assert "not running after 0.5 s: w1 (exited:1)" in r.stderr
  assert "w1| last line of w1 (exited:1)" in r.stdout  # its log's end, with its host
  assert fake.verbs() == ["ssh:preflight", "ssh:run", "ssh:check"]
  for argv in fake.calls:  # every worker of every slice
    assert argv[4:7] == ["pod", "--node=all", "--worker=all"]
  # All alive: the run goes on.
  fake = Fake(tmp_path / "ok")
  r = fake.launch("run", *SLICE, "--accelerator-type=v5p-16", *JOB)
  assert r.returncode == 0, r.stderr
  assert "all 2 workers running" in r.stdout
  # A worker that did not answer at all (2 of 4 hosts of a v5p-32).
  r = Fake(tmp_path / "few").launch("run", *SLICE, "--accelerator-type=v5p-32", *JOB)
  assert r.returncode == 1 and "2 of 4 workers answered" in r.stderr


def test_a_version_mismatch_stops_the_run(tmp_path):
  fake = Fake(tmp_path, versions=[host_versions("w0") + "\n" + host_versions("w1", jax="0.10.1")])
  r = fake.launch("run", *SLICE, "--accelerator-type=v5p-16", *JOB)
  assert r.returncode == 1
  assert "refusing to start: the workers run different jax: 0.10.2 on w0, 0.10.1 on w1" in r.stderr
  assert "jax 0.10.1 != 0.10.2 of the lock on w1" in r.stderr
  assert fake.verbs() == ["ssh:preflight"]  # nothing started
  # Workers that agree with each other and the lock, but not with what bertjax.aot compiled.
  report = tmp_path / "aot.json"
  report.write_text(json.dumps({"versions": versions.format_versions(
      {**versions.read_lock(), "libtpu": "0.0.40"})}))
  fake = Fake(tmp_path / "aot")
  r = fake.launch("run", *SLICE, "--accelerator-type=v5p-16", f"--aot-report={report}", *JOB)
  assert r.returncode == 1
  assert "libtpu 0.0.42.1 != 0.0.40 of bertjax.aot's report on w0, w1" in r.stderr
  assert "the workers run different" not in r.stderr and "of the lock" not in r.stderr
  assert fake.verbs() == ["ssh:preflight"]
  report.write_text(json.dumps({"versions": LOCKED}))
  r = Fake(tmp_path / "same").launch("run", *SLICE, "--accelerator-type=v5p-16",
                                     f"--aot-report={report}", *JOB)
  assert r.returncode == 0, r.stderr
  assert f"all as launch/requirements-tpu.lock and {report}" in r.stdout


def test_later_commands_need_only_the_name(tmp_path):
  fake = Fake(tmp_path, describe=["NOT_FOUND", "ACTIVE"],
              check=[workers(**{f"w{i}": "running" for i in range(4)})],
              versions=[host_versions(*[f"w{i}" for i in range(4)])])
  r = fake.launch("up", *SLICE, "--accelerator-type=v5p-16", "--num-slices=2", "--spot", *FAST,
                  *JOB, "--config.mesh.dcn_data=2")
  assert r.returncode == 0, r.stderr
  create = [c for c in fake.calls if c[3] == "create"][0]
  assert "--node-count=2" in create and "--node-prefix=pod" in create
  recorded = fake.state()
  assert (recorded["num_slices"], recorded["zone"], recorded["accelerator_type"]) == (
      2, "us-east5-a", "v5p-16")
  assert recorded["flags"] == ["--config.data.cache_dir=gs://b/cache", "--config.mesh.dcn_data=2"]
  before = len(fake.calls)
  for sub in (["stop"], ["status"], ["logs", "--worker=3"], ["setup"], ["run", "--check-after=0"]):
    r = fake.launch(sub[0], "--name=pod", *FAST, *sub[1:])
    assert r.returncode == 0, (sub, r.stderr)
  later = fake.calls[before:]
  assert all("--zone=us-east5-a" in c and "--project=p" in c for c in later)
  stop, *_ = [c for c in later if c[3] == "ssh"]
  assert stop[4:7] == ["pod", "--node=all", "--worker=all"]
  assert ["pod", "--node=0", "--worker=3"] in [c[4:7] for c in later]
  # `run` with the name only restarts the recorded job, checked against the recorded 2 slices.
  (job,) = [c for c in later if "bertjax-job" in c[-1]]
  assert "--config.mesh.dcn_data=2" in job[-1] and "--workdir=gs://b/run" in job[-1]
  # Another --num-slices would target a resource that does not exist.
  r = fake.launch("stop", "--name=pod", "--num-slices=1")
  assert r.returncode == 1 and "was created with 2 slices" in r.stderr
  r = Fake(tmp_path / "none").launch("stop", "--name=other")
  assert r.returncode == 1 and "--zone is needed" in r.stderr


def test_watch_recreates_a_preempted_slice_and_restarts_the_same_job(tmp_path):
  running, done = workers(w0="running", w1="running"), workers(w0="exited:0", w1="exited:0")
  fake = Fake(tmp_path, describe=["NOT_FOUND", "ACTIVE", "SUSPENDED", "ACTIVE", "ACTIVE"],
              check=[running, running, done])
  r = fake.launch("up", *SLICE, "--accelerator-type=v5p-16", "--spot", "--watch",
                  "--watch-seconds=0", "--extra-create-flags=--network=n1", *FAST, *JOB)
  assert r.returncode == 0, r.stderr + r.stdout
  assert fake.verbs() == [
      "describe", "create", "describe", "scp", "ssh:setup", "ssh:preflight", "ssh:run", "ssh:check",
      "describe",  # watch: SUSPENDED
      "delete", "create", "describe", "scp", "ssh:setup", "ssh:preflight", "ssh:run", "ssh:check",
      "describe", "ssh:check"]  # watch: ACTIVE, and the job has finished on every worker
  creates = [c for c in fake.calls if c[3] == "create"]
  runs = [c for c in fake.calls if "bertjax-job" in c[-1]]
  assert creates[0] == creates[1] and "--network=n1" in creates[0] and "--spot" in creates[0]
  assert runs[0] == runs[1]  # the same flags: the job resumes from the workdir's checkpoint
  events = (tmp_path / "state" / "pod.events.log").read_text()
  for event in ("pod: SUSPENDED: delete, recreate, set up, restart (1/5)", "pod: ACTIVE again",
                "restarted with the same flags", "the job finished on all 2 workers"):
    assert event in events and event in r.stdout
  # Bounded: a slice preempted more often than --max-restarts allows ends the watch.
  fake = Fake(tmp_path / "again", describe=["ACTIVE", "SUSPENDED", "ACTIVE", "SUSPENDED"])
  r = fake.launch("up", *SLICE, "--accelerator-type=v5p-16", "--watch", "--watch-seconds=0",
                  "--max-restarts=1", *FAST, *JOB)
  assert r.returncode == 1 and "preempted 2 times (--max-restarts=1)" in r.stderr
  assert fake.verbs().count("create") == 1  # ACTIVE at first: up skipped create


def test_waiting_retries_transient_errors_and_stops_on_terminal_states(tmp_path):
  fake = Fake(tmp_path, describe=["ERROR", "ERROR", "ACTIVE"])
  r = fake.launch("create", *SLICE, "--accelerator-type=v5p-8", *FAST)
  assert r.returncode == 0, r.stderr
  assert r.stdout.count("describe failed (ERROR: (gcloud.compute.tpus.queued-resources.describe) "
                        "ERROR: Unavailable); retrying") == 2
  failed = json.dumps({"state": {"state": "FAILED", "failedData": {"error": {
      "message": "Quota exceeded for v5p chips"}}}})
  for i, (state, message) in enumerate([
      (failed, "is FAILED: Quota exceeded for v5p chips"), ("SUSPENDED", "is SUSPENDED"),
      ("DELETING", "is DELETING")]):
    r = Fake(tmp_path / str(i), describe=["WAITING_FOR_RESOURCES", state]).launch(
        "create", *SLICE, "--accelerator-type=v5p-8", *FAST)
    assert r.returncode == 1 and message in r.stderr, r.stderr
  r = Fake(tmp_path / "slow", describe=["WAITING_FOR_RESOURCES"]).launch(
      "create", *SLICE, "--accelerator-type=v5p-8", "--poll-seconds=0.05", "--max-wait=0.3")
  assert r.returncode == 1
  assert "still WAITING_FOR_RESOURCES after 0.3 s (--max-wait)" in r.stderr
  r = Fake(tmp_path / "gone", describe=["ERROR"]).launch("create", *SLICE,
                                                         "--accelerator-type=v5p-8", *FAST)
  assert r.returncode == 1 and "describe failed 6 times in a row" in r.stderr


def test_up_uses_an_existing_slice(tmp_path):
  fake = Fake(tmp_path, describe=["ACTIVE"])
  r = fake.launch("up", *SLICE, "--accelerator-type=v5p-16", *FAST, *JOB)
  assert r.returncode == 0, r.stderr
  assert "up: skips create" in r.stdout and "create" not in fake.verbs()
  # A preempted one is deleted and created again; a queued one is waited for.
  fake = Fake(tmp_path / "pre", describe=["SUSPENDED", "NOT_FOUND", "ACTIVE"])
  assert fake.launch("up", *SLICE, "--accelerator-type=v5p-16", *FAST, *JOB).returncode == 0
  assert fake.verbs()[:5] == ["describe", "delete", "describe", "create", "describe"]
  fake = Fake(tmp_path / "queued", describe=["PROVISIONING", "PROVISIONING", "ACTIVE"])
  assert fake.launch("up", *SLICE, "--accelerator-type=v5p-16", *FAST, *JOB).returncode == 0
  assert fake.verbs()[:4] == ["describe", "describe", "describe", "scp"]


EXTRA_CREATE = ["--extra-create-flags=--network=projects/p/global/networks/n "
                "--subnetwork='my subnet' --service-account=sa@p.iam.gserviceaccount.com "
                "--internal-ips", "--extra-create-flags=--reservation=res-1"]
EXTRA_CREATE_VALUES = [f.split("=", 1)[1] for f in EXTRA_CREATE]
PASSED = ["--network=projects/p/global/networks/n", "--subnetwork=my subnet",
          "--service-account=sa@p.iam.gserviceaccount.com", "--internal-ips", "--reservation=res-1"]


def test_extra_create_flags_pass_through_verbatim(tmp_path):
  fake = Fake(tmp_path)
  r = fake.launch("create", *SLICE, "--accelerator-type=v5p-8", "--spot", *EXTRA_CREATE,
                  *FAST)
  assert r.returncode == 0, r.stderr
  (create,) = [c for c in fake.calls if c[3] == "create"]
  assert create[-len(PASSED) - 1:] == ["--spot", *PASSED]  # what gcloud received
  (printed,) = [l for l in r.stdout.splitlines() if l.startswith("+ gcloud") and " create " in l]
  assert shlex.split(printed[2:])[1:] == create  # the printed command is the one run
  assert fake.state()["extra_create_flags"] == EXTRA_CREATE_VALUES
  dry = fake.launch("create", *SLICE, "--accelerator-type=v5p-8", *EXTRA_CREATE, "--dry-run")
  assert dry.returncode == 0 and "'--subnetwork=my subnet'" in dry.stdout
  # Remembered: the flags come back without being given; a tier given replaces the recorded one.
  dry = fake.launch("create", "--name=pod", "--reserved", "--dry-run")
  (printed,) = [l for l in dry.stdout.splitlines() if l.startswith("+ gcloud") and " create " in l]
  assert shlex.split(printed[2:])[-len(PASSED) - 1:] == ["--reserved", *PASSED], dry.stderr


def test_delete_collects_the_logs_first(tmp_path):
  fake = Fake(tmp_path)
  assert fake.launch("run", *SLICE, "--accelerator-type=v5p-16", *JOB).returncode == 0
  r = fake.launch("delete", "--name=pod")
  assert r.returncode == 0, r.stderr
  assert fake.verbs()[-2:] == ["ssh:collect", "delete"]
  assert "--dest=gs://b/run/logs/\"$(hostname)\".log" in fake.calls[-2][-1]
  assert not (tmp_path / "state" / "pod.json").exists()  # forgotten with the resource
  # Workers that do not answer (a preempted slice): deleted all the same.
  fake = Fake(tmp_path / "gone", fail_on=["launch.logsync --once"])
  assert fake.launch("run", *SLICE, "--accelerator-type=v5p-16", *JOB).returncode == 0
  r = fake.launch("delete", "--name=pod")
  assert r.returncode == 0 and "the logs were not all collected" in r.stdout
  assert fake.verbs()[-1] == "delete"


def test_delete_s_collection_copies_a_log_into_a_folder_standing_in_for_the_bucket(tmp_path):
  # The copies during a run and at its end: test_launch_tpu.py's stand-in worker.
  home = tmp_path / "home"
  (home / "bertjax-logs").mkdir(parents=True)
  (home / "bertjax").symlink_to(REPO)
  (home / "bertjax-venv" / "bin").mkdir(parents=True)
  python = home / "bertjax-venv" / "bin" / "python"
  python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  python.chmod(0o755)
  (home / "bertjax-logs" / "train.log").write_text("=== start\nstep 100\n")
  bucket = tmp_path / "bucket" / "my run"
  r = subprocess.run(["bash", "-c", tpu_remote.collect_script(str(bucket))], capture_output=True,
                     text=True, timeout=120, check=False,
                     env={"HOME": str(home), "PATH": os.environ["PATH"], "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert r.returncode == 0, r.stderr
  host = os.uname().nodename
  assert (bucket / "logs" / f"{host}.log").read_text() == "=== start\nstep 100\n"
  assert f"{host}: log copied to" in r.stdout


@pytest.fixture
def holder(tmp_path):
  """A process holding a stand-in TPU device open, as a stale job holds /dev/accel0."""
  device = tmp_path / "accel0"
  device.write_text("")
  p = subprocess.Popen([sys.executable, "-c", f"f = open({str(device)!r}); import time; "
                        "time.sleep(60)"])
  def holds() -> bool:
    for fd in os.listdir(f"/proc/{p.pid}/fd"):
      try:
        if os.readlink(f"/proc/{p.pid}/fd/{fd}") == str(device):
          return True
      except FileNotFoundError:  # closed between the listing and the look: Python starting up
        pass
    return False

  for _ in range(100):
    if holds():
      break
    time.sleep(0.05)
  yield p
  if p.poll() is None:
    p.kill()


def test_preflight_stops_what_holds_the_tpu_and_removes_a_stale_lock(tmp_path, holder):
  home = tmp_path / "home"
  (home / "bertjax-venv" / "bin").mkdir(parents=True)
  (home / "bertjax").symlink_to(REPO)
  python = home / "bertjax-venv" / "bin" / "python"
  python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  python.chmod(0o755)
  lock = tmp_path / "libtpu_lockfile"
  env = {"HOME": str(home), "PATH": os.environ["PATH"]}

  def preflight(clean):
    lock.write_text("")
    script = tpu_remote.preflight_script(clean, devices=(str(tmp_path / "accel*"),),
                                         lockfile=str(lock))
    # Only this test's jobs count as running (the machine may run real ones).
    script = script.replace("bertjax[.](", f"bjtest{os.getpid()}[.](")
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)

  r = preflight(clean=False)  # --skip-preflight: nothing stopped, nothing removed
  assert r.returncode == 0, r.stderr
  assert holder.poll() is None and lock.exists()
  r = preflight(clean=True)
  assert r.returncode == 0, r.stderr
  assert f"pre-flight: stopping PID {holder.pid}, which holds the TPU" in r.stdout
  assert holder.wait(timeout=10) == -9 and not lock.exists()
  assert "removed a stale" in r.stdout
  (found,) = tpu_remote.parse_host_versions(r.stdout).values()
  assert found == versions.installed(versions.read_lock())


def test_the_lock_installs_beside_the_package_it_pins():
  # `launch/tpu.py setup` installs `-r LOCK -e .[tpu]` on each worker: a pin outside setup.py's
  # range for the same package is pip's ResolutionImpossible on every worker, before any job runs.
  kwargs = {}
  with mock.patch.object(setuptools, "setup", lambda **kw: kwargs.update(kw)):
    runpy.run_path(str(REPO / "setup.py"))
  pins = versions.read_lock()
  checked = set()
  for line in kwargs["install_requires"] + kwargs["extras_require"]["tpu"]:
    wanted = Requirement(line)
    name = versions.canonical(wanted.name)
    if name in pins:
      assert wanted.specifier.contains(pins[name], prereleases=True), (
          f"launch/requirements-tpu.lock pins {name}=={pins[name]}, setup.py asks for "
          f"{wanted.specifier}")
      checked.add(name)
  assert {"jax", "libtpu", "sentencepiece", "ml-dtypes", "numpy"} <= checked, checked
