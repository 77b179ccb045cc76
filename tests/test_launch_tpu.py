"""launch.tpu: the commands a dry run prints, their quoting, the inputs it refuses, and its
remote scripts run on this machine as on a worker.

No gcloud is needed (nor run): --dry-run starts no subprocess, which one test checks with a PATH
that has neither gcloud nor git, and another by making subprocess raise. What the launcher does
with gcloud's answers is tested in test_launch_tpu_ops.py, with a fake gcloud.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from launch import tpu, tpu_plan, tpu_remote

REPO = pathlib.Path(__file__).resolve().parent.parent
SLICE = ["--name=bert-large", "--zone=us-east5-a", "--project=my-project"]
JOB = ["--config=configs/bert_large.py", "--workdir=gs://bucket/run"]
# Flags for bertjax.pretrain that need quoting on the remote shell: a glob, a space, a dollar sign.
EXTRA = ["--config.data.cache_dir=gs://bucket/bertjax-cache",
         "--config.data.source=gs://bucket/text/wiki-*.txt.gz,gs://bucket/my books/*.txt",
         "--config.train.batch_size=4096", "--config.data.vocab_path=gs://bucket/$odd/vocab.txt"]


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
  """The launcher's memory of resources, here and in the launchers it starts: this test's own."""
  monkeypatch.setenv("BERTJAX_TPU_STATE", str(tmp_path / "state"))
  return tmp_path / "state"


def launch(*args, env=None):
  return subprocess.run([sys.executable, "-m", "launch.tpu", *args], capture_output=True,
                        text=True, cwd=REPO, env=env, check=False, timeout=120)


def commands(stdout: str) -> list[list[str]]:
  """The printed commands (`+ ...` lines, possibly spanning lines inside quotes), as argv lists."""
  out, current = [], None
  for line in stdout.splitlines(keepends=True):
    if current is None and line.startswith("+ "):
      current = line[2:]
    elif current is not None:
      current += line
    else:
      continue
    try:
      out.append(shlex.split(current))
      current = None
    except ValueError:  # an open quote: the command goes on on the next line
      pass
  assert current is None, f"unterminated command: {current!r}"
  return out


def find(cmds, *words):
  """The commands whose argv starts with `words`."""
  return [c for c in cmds if c[:len(words)] == list(words)]


def remote(cmd) -> str:
  (script,) = [a[len("--command="):] for a in cmd if a.startswith("--command=")]
  return script


def remote_argv(script: str, marker: str) -> list[str]:
  """What the remote shell passes to the program on the script line containing `marker`."""
  (line,) = [l for l in script.splitlines() if marker in l]
  head, _, rest = line.partition(marker)
  assert head.startswith("setsid nohup bash -c ") and head.endswith(
      " bertjax-job $HOME/bertjax-venv/bin/python ")
  args = rest.split(" < /dev/null")[0]
  out = subprocess.run(["bash", "-c", f"printf '%s\\n' {args}"], capture_output=True, text=True,
                       check=True, env={"HOME": "/home/u", "PATH": os.environ["PATH"]})
  return out.stdout.splitlines()


def test_up_dry_run_multi_host_spot_prints_every_step():
  r = launch("up", *SLICE, "--accelerator-type=v5p-128", "--spot", *JOB, "--dry-run", "--", *EXTRA)
  assert r.returncode == 0, r.stderr
  cmds = commands(r.stdout)

  (create,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create", "bert-large")
  for flag in ("--node-id=bert-large", "--accelerator-type=v5p-128",
               "--runtime-version=v2-alpha-tpuv5", "--spot", "--zone=us-east5-a",
               "--project=my-project"):
    assert flag in create
  assert not any(a.startswith("--node-count") for a in create)
  # Whether it exists (up skips create for an ACTIVE one), then the wait until ACTIVE.
  exists, describe = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "describe")
  assert exists == describe and "--format=json(state)" in describe
  assert "v5p-128: 64 chips (JAX devices) in 4x4x4, 16 hosts" in r.stdout

  (archive,) = find(cmds, "git", "-C", ".", "archive")  # the launcher ran from the project root
  tarball = [a for a in archive if a.startswith("--output=")][0][len("--output="):]
  # One slice or several: every worker through queued-resources ssh/scp --node=all.
  (copy,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "scp", tarball)
  assert "--node=all" in copy and "--worker=all" in copy
  setup, preflight, run, check, follow = find(cmds, "gcloud", "compute", "tpus", "queued-resources",
                                              "ssh", "bert-large", "--node=all", "--worker=all")
  script = remote(setup)
  # The lock's exact versions, with the tpu extra (libtpu).
  assert ('pip install --quiet -r $HOME/bertjax/launch/requirements-tpu.lock -e '
          '"$HOME/bertjax[tpu]"') in script
  assert "venv --seed --python 3.11" in script  # setup.py's python_requires
  assert "find /proc/[0-9]*/fd" in remote(preflight) and "rm -f /tmp/libtpu_lockfile" in remote(
      preflight) and "bertjax.versions" in remote(preflight)

  # The job's argv on each worker, after the local shell and the remote shell have parsed it.
  script = remote(run)
  assert "bertjax-job $HOME/bertjax-venv/bin/python -m bertjax.pretrain --config=configs/bert_large.py" \
         " --workdir=gs://bucket/run" in script
  assert "< /dev/null > /dev/null 2>&1 &" in script and ">> $HOME/bertjax-logs/train.log 2>&1" in script
  assert remote_argv(script, "-m bertjax.pretrain") == [
      "--config=configs/bert_large.py", "--workdir=gs://bucket/run", *EXTRA]
  assert "-m launch.logsync" in script and '--dest=gs://bucket/run/logs/"$(hostname)".log' in script
  assert "bertjax-worker" in remote(check) and "after 120 s" in r.stdout

  assert remote(follow) == 'tail -n 50 -F $HOME/bertjax-logs/train.log | sed -u "s/^/$(hostname)| /"'
  # Order: exists?, create, wait, setup, pre-flight, run, check, then follow every log.
  order = [cmds.index(c) for c in (create, archive, copy, setup, preflight, run, check, follow)]
  assert order == sorted(order) and cmds.index(exists) < cmds.index(create)


def test_multi_slice_uses_node_count_and_every_node():
  r = launch("up", *SLICE, "--accelerator-type=v5p-128", "--num-slices=2", "--reserved", *JOB,
             "--dry-run", "--", "--config.data.cache_dir=gs://bucket/cache",
             "--config.mesh.dcn_data=2")
  assert r.returncode == 0, r.stderr
  cmds = commands(r.stdout)
  (create,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create", "bert-large")
  assert "--node-count=2" in create and "--node-prefix=bert-large" in create
  assert "--reserved" in create and "--spot" not in create
  assert not any(a.startswith("--node-id") for a in create)
  (copy,) = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "scp")
  assert "--node=all" in copy and "--worker=all" in copy
  setup, _, run, _, logs = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "ssh",
                                "bert-large", "--node=all", "--worker=all")
  assert "[tpu]" in remote(setup)
  assert "--config.mesh.dcn_data=2" in remote_argv(remote(run), "-m bertjax.pretrain")
  assert "tail" in remote(logs)
  assert "32 hosts" in r.stderr  # 16 shards for 2 x 16 hosts: a warning, not an error


@pytest.mark.parametrize("flags, fragment", [
    (["--config.mesh.dcn_data=4"], "dcn_data=4, dcn_fsdp=1, dcn_tensor=1 multiplies to 4, but there are 2"),
    (["--config.mesh.dcn_data=1"], "set --config.mesh.dcn_data=2 (or -1)"),
    (["--config.mesh.dcn_fsdp", "3"], "needs a multiple of 3, but there are 2"),
])
def test_multi_slice_refuses_a_dcn_mesh_of_another_size(flags, fragment):
  r = launch("up", *SLICE, "--accelerator-type=v5p-128", "--num-slices=2", *JOB, "--dry-run", "--",
             "--config.data.cache_dir=gs://bucket/cache", *flags)
  assert r.returncode != 0
  assert fragment in r.stderr and "--num-slices=2" in r.stderr
  assert "queued-resources create" not in r.stdout  # refused before anything is created


def test_dcn_check_defaults_and_ici():
  mesh = {"ici_data": -1, "ici_fsdp": 1, "ici_tensor": 1, "dcn_data": -1, "dcn_fsdp": 1,
          "dcn_tensor": 1}
  v5p = tpu_plan.parse_accelerator("v5p-128")
  assert tpu_plan.check_mesh(mesh, v5p, 1) == [] and tpu_plan.check_mesh(mesh, v5p, 4) == []
  assert tpu_plan.check_mesh({**mesh, "dcn_data": 2}, v5p, 2) == []
  assert "num-slices=1" in tpu_plan.check_mesh({**mesh, "dcn_data": 2}, v5p, 1)[0]
  assert "64 devices" in tpu_plan.check_mesh({**mesh, "ici_data": 16, "ici_tensor": 2}, v5p, 1)[0]
  assert tpu_plan.check_mesh({**mesh, "ici_fsdp": -1}, v5p, 1)  # two -1 in one group
  assert tpu_plan.config_overrides(["--config.mesh.dcn_data", "2", "--config.data.nsp", "--x=1",
                               "--config.mesh.dcn_data=3"]) == {"mesh.dcn_data": "3"}


@pytest.mark.parametrize("workdir", ["/tmp/run", "workdirs/large", "gcs/bucket/run"])
def test_refuses_a_workdir_off_gs_for_multi_host(workdir):
  r = launch("up", *SLICE, "--accelerator-type=v5p-128", "--config=configs/bert_large.py",
             f"--workdir={workdir}", "--dry-run", "--", "--config.data.cache_dir=gs://b/c")
  assert r.returncode != 0
  assert f"--workdir={workdir} is not on gs://" in r.stderr
  assert "+ gcloud" not in r.stdout
  # A single-host slice may write locally (nothing to share), if the user wants that.
  ok = launch("run", *SLICE, "--accelerator-type=v5litepod-8", "--config=configs/tiny.py",
              f"--workdir={workdir}", "--dry-run")
  assert ok.returncode == 0, ok.stderr


def test_refuses_data_cache_a_multi_host_job_cannot_share():
  r = launch("run", *SLICE, "--accelerator-type=v5p-128", *JOB, "--dry-run")
  assert r.returncode != 0 and "--config.data.cache_dir=gs://" in r.stderr
  ok = launch("run", *SLICE, "--accelerator-type=v5p-128", *JOB, "--dry-run", "--",
              "--config.data.prepared_dir=gs://b/prepared", "--config.data.vocab_path=gs://b/v.txt")
  assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("accel, why", [
    ("v5p-24", "v5p has no slice of 24 TensorCores (2 per chip); nearest: v5p-16 (2x2x2), "
               "v5p-32 (2x2x4)"),
    ("v5p-12", "nearest: v5p-8 (2x2x1), v5p-16 (2x2x2)"), ("v5p-4", "nearest: v5p-8"),
    ("v7-8", "the generations known here are v4, v5p, v5litepod, v6e"), ("tpu7x-8", "v5p-128xN"),
    ("v5e-16", "Cloud TPU calls it v5litepod-16"), ("v6e-12", "nearest: v6e-8 (2x4), v6e-16 (4x4)"),
    ("v5p", "v4-8, v4-16")])
def test_refuses_an_unknown_accelerator_type(accel, why):
  r = launch("create", *SLICE, f"--accelerator-type={accel}", "--dry-run")
  assert r.returncode != 0
  assert f"Unknown accelerator type {accel!r}" in r.stderr and why in r.stderr
  assert "+ gcloud" not in r.stdout


def test_accelerator_types_and_runtime_versions():
  cases = {"v5p-8": (4, 1, "v2-alpha-tpuv5"), "v5p-128": (64, 16, "v2-alpha-tpuv5"),
           "v5p-384": (192, 48, "v2-alpha-tpuv5"), "v5p-640": (320, 80, "v2-alpha-tpuv5"),
           "v4-384": (192, 48, "tpu-ubuntu2204-base"),
           "v4-32": (16, 4, "tpu-ubuntu2204-base"), "v5litepod-8": (8, 1, "v2-alpha-tpuv5-lite"),
           "v5litepod-64": (64, None, "v2-alpha-tpuv5-lite"), "v6e-256": (256, None, "v2-alpha-tpuv6e")}
  for name, (chips, hosts, runtime) in cases.items():
    a = tpu_plan.parse_accelerator(name)
    assert (a.chips, a.hosts, a.runtime_version) == (chips, hosts, runtime), name
    assert a.multi_host == (hosts != 1)


def test_dry_run_needs_no_gcloud_nor_git(tmp_path):
  """PATH without gcloud or git: every subcommand's dry run still prints its commands."""
  env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
  r = launch("up", *SLICE, "--accelerator-type=v5p-128", "--spot", *JOB, "--dry-run", "--",
             "--config.data.cache_dir=gs://b/c", env=env)
  assert r.returncode == 0, r.stderr
  assert "+ gcloud compute tpus queued-resources create" in r.stdout
  for sub in (["setup"], ["logs"], ["logs", "--worker=all"], ["status"], ["stop"], ["delete"],
              ["setup", "--repo=https://x/y.git"]):
    r = launch(*sub, *SLICE, "--dry-run", env=env)
    assert r.returncode == 0, (sub, r.stderr)
    assert "+ gcloud" in r.stdout


def test_dry_run_starts_no_subprocess(monkeypatch, capsys):
  def forbidden(*args, **kwargs):
    raise AssertionError(f"subprocess started in a dry run: {args}")
  for name in ("run", "Popen", "call", "check_call", "check_output"):
    monkeypatch.setattr(subprocess, name, forbidden)
  monkeypatch.setattr(os, "system", forbidden)
  argv = ["up", *SLICE, "--accelerator-type=v5p-128", "--spot", *JOB, "--dry-run", "--",
          "--config.data.cache_dir=gs://b/c"]
  assert tpu.main(argv) == 0
  for sub in ("setup", "logs", "status", "stop", "delete"):
    assert tpu.main([sub, *SLICE, "--dry-run"]) == 0
  assert tpu.main(["up", *SLICE, "--accelerator-type=v5p-8", "--watch", *JOB, "--dry-run"]) == 0
  assert "+ gcloud compute tpus queued-resources ssh" in capsys.readouterr().out


def test_stop_signals_only_the_training_process():
  r = launch("stop", *SLICE, "--dry-run")
  assert r.returncode == 0
  (cmd,) = commands(r.stdout)
  script = remote(cmd)
  assert script.startswith(f'if pkill -TERM -f "{tpu_remote.TRAINING_PROCESS}"')
  # The pattern finds the job (python ... -m bertjax.pretrain ...), never a remote shell running one
  # of these scripts (whose command line holds the same words), so pkill spares its own shell.
  job = "/home/u/bertjax-venv/bin/python -m bertjax.pretrain --config=configs/bert_large.py"
  assert re.search(tpu_remote.TRAINING_PROCESS, job)
  assert re.search(tpu_remote.TRAINING_PROCESS, "python3 -m bertjax.pretrain --config=c --workdir=w")
  # A job started under the command's old name is found too.
  assert re.search(tpu_remote.TRAINING_PROCESS, "python3 -m bertjax.main --config=c --workdir=w")
  plan = tpu_remote.RunPlan("configs/bert_large.py", "gs://b/r", [], [])
  for text in (script, tpu_remote.run_script(plan), "bash -c " + tpu_remote.run_script(plan)):
    assert not re.search(tpu_remote.TRAINING_PROCESS, text)
  assert "the loop saves a checkpoint" in " ".join(launch("stop", "--help").stdout.split())
  (kill,) = commands(launch("stop", *SLICE, "--kill", "--dry-run").stdout)
  assert remote(kill).startswith(f'pkill -KILL -f "{tpu_remote.TRAINING_PROCESS}"')
  assert not re.search(tpu_remote.TRAINING_PROCESS, tpu_remote.kill_script())


def test_setup_from_a_git_url_clones_instead_of_copying():
  r = launch("setup", *SLICE, "--repo=https://github.com/me/bertjax.git", "--ref=v1",
             "--dry-run")
  assert r.returncode == 0
  (cmd,) = commands(r.stdout)
  script = remote(cmd)
  assert "git clone --quiet https://github.com/me/bertjax.git $HOME/bertjax" in script
  assert "checkout --quiet v1" in script and "tar -xzf" not in script


def test_flags_after_dashes_only_for_the_job():
  r = launch("create", *SLICE, "--accelerator-type=v5p-8", "--dry-run", "--", "--x=1")
  assert r.returncode == 2 and "take" in r.stderr


@pytest.mark.parametrize("args, said", [
    (["status", *SLICE, "--spot"], "launch.tpu status: error: Unknown command line flag 'spot'"),
    (["stauts", *SLICE], "launch.tpu: error: unknown command 'stauts'"),
    (["status", "--zone=z"], "launch.tpu status: error: flag --name=None"),
    (["create", *SLICE, "--spot", "--reserved"],
     "launch.tpu create: error: flags spot=True, reserved=True: At most one of (spot, reserved)"),
])
def test_a_command_line_it_cannot_run_is_one_line_with_exit_status_2(args, said):
  r = launch(*args, "--dry-run")
  assert r.returncode == 2 and r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr
  assert "+ gcloud" not in r.stdout


def test_run_as_a_file_it_says_how_to_run_it():
  """`python launch/tpu.py`: no `launch` package to import from; the message says what works."""
  r = subprocess.run([sys.executable, str(REPO / "launch" / "tpu.py"), "status", *SLICE],
                     capture_output=True, text=True, cwd=REPO, check=False, timeout=60)
  assert r.returncode == 1 and "run `python -m launch.tpu ...`" in r.stderr, r.stderr
  assert "launch/tpu.sh" in r.stderr and "Traceback" not in r.stderr


def fake_gcloud(tmp_path, states=(), fail_on=None):
  """A `gcloud` that records its arguments; `describe` answers the next of `states`."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  log, queue = tmp_path / "calls.txt", tmp_path / "states.txt"
  queue.write_text("".join(f"{s}\n" for s in states))
  script = tmp_path / "bin" / "gcloud"
  script.parent.mkdir(parents=True)
  script.write_text(f"""#!/bin/sh
printf '%s\\n' "$*" >> {log}
case "$*" in
  *" describe "*) head -n 1 {queue}; sed -i 1d {queue};;
  *"{fail_on or '@never@'}"*) exit 3;;
esac
""")
  script.chmod(0o755)
  env = {**os.environ, "PATH": f"{script.parent}{os.pathsep}{os.environ['PATH']}"}
  return env, log


def test_create_waits_until_active(tmp_path):
  env, log = fake_gcloud(tmp_path, ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"])
  r = launch("create", *SLICE, "--accelerator-type=v5p-8", "--poll-seconds=0", env=env)
  assert r.returncode == 0, r.stderr
  calls = log.read_text().splitlines()
  assert calls[0].startswith("compute tpus queued-resources create bert-large --node-id=bert-large")
  assert sum("describe" in c for c in calls) == 3
  assert "bert-large: PROVISIONING" in r.stdout and "bert-large: ACTIVE" in r.stdout
  assert r.stdout.count("+ gcloud compute tpus queued-resources describe") == 1


def test_failures_are_reported_with_the_command(tmp_path):
  env, _ = fake_gcloud(tmp_path, ["WAITING_FOR_RESOURCES", "FAILED"])
  r = launch("create", *SLICE, "--accelerator-type=v5p-8", "--poll-seconds=0", env=env)
  assert r.returncode != 0 and "is FAILED" in r.stderr and "delete" in r.stderr
  env, _ = fake_gcloud(tmp_path / "again", fail_on="queued-resources ssh")
  r = launch("stop", *SLICE, env=env)
  assert r.returncode != 0
  assert "exit status 3: gcloud compute tpus queued-resources ssh bert-large" in r.stderr


def test_remote_scripts_are_valid_shell():
  plan = tpu_remote.RunPlan("configs/bert_large.py", "gs://b/r", EXTRA, [])
  for script in (tpu_remote.setup_script(None, None, "3.11"), tpu_remote.setup_script("https://x/y.git", "main",
                                                                        "3.11"),
                 tpu_remote.preflight_script(), tpu_remote.preflight_script(clean=False), tpu_remote.run_script(plan),
                 tpu_remote.run_script(plan, sync_every=0), tpu_remote.check_script(), tpu_remote.follow_script(True),
                 tpu_remote.follow_script(False), tpu_remote.collect_script("gs://b/my run"),
                 tpu_remote.stop_script(60), tpu_remote.kill_script()):
    subprocess.run(["bash", "-n", "-c", script], check=True)


def stand_in_worker(tmp_path, body: str):
  """A worker's home with the project (this one's launch/ and bertjax/ folders), a venv (this
  Python) and a stand-in for bertjax.pretrain under a unique module name, so that only this test's
  processes match the scripts' patterns. Returns (home, env, mine: the scripts with the
  stand-in's name)."""
  module = f"bjtest{os.getpid()}x{abs(hash(str(tmp_path))) % 10**8}"
  home = tmp_path / "home"
  (home / "bertjax" / module).mkdir(parents=True)
  for folder in ("launch", "bertjax"):
    (home / "bertjax" / folder).symlink_to(REPO / folder)
  (home / "bertjax" / module / "__init__.py").write_text("")
  (home / "bertjax" / module / "pretrain.py").write_text(body)
  (home / "bertjax-venv" / "bin").mkdir(parents=True)
  venv_python = home / "bertjax-venv" / "bin" / "python"
  venv_python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # a symlink would lose the venv
  venv_python.chmod(0o755)
  mine = lambda s: s.replace("bertjax.pretrain", f"{module}.pretrain").replace(
      "bertjax[.](pretrain|main)", f"{module}[.](pretrain|main)")
  return home, {"HOME": str(home), "PATH": os.environ["PATH"]}, mine


def bash(script, env, timeout=60):
  return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)


def wait_for(predicate, seconds=30):
  for _ in range(int(seconds * 10)):
    if predicate():
      return True
    subprocess.run(["sleep", "0.1"], check=True)
  return predicate()


def kill_if_mine(module: str):
  """This test's stand-in job and its wrapper, if still there: the only processes whose command
  line holds the test's unique module name."""
  for proc in pathlib.Path("/proc").glob("[0-9]*"):
    try:
      if module in (proc / "cmdline").read_text(errors="replace"):
        os.kill(int(proc.name), 9)
    except (OSError, ProcessLookupError):
      pass


def test_run_check_stop_on_a_stand_in_worker(tmp_path):
  """The run, check and stop scripts on this machine: the job starts detached, a second start is
  refused, the check sees it running, stop delivers SIGTERM and waits for the exit, the check
  then reads its exit status; the log reaches WORKDIR/logs/HOST.log in a local folder standing
  in for the bucket, during the run and at its end."""
  home, env, mine = stand_in_worker(tmp_path, (
      "import signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda *a: (print('SIGTERM: saved', flush=True), sys.exit(0)))\n"
      "print('args', sys.argv[1:], flush=True)\n"
      "for _ in range(1200):\n  time.sleep(0.1)\n"))
  bucket = tmp_path / "bucket" / "run"
  plan = tpu_remote.RunPlan("configs/bert_large.py", str(bucket), EXTRA, [])
  start = bash(mine(tpu_remote.run_script(plan, sync_every=0.2)), env)
  found = re.search(r"pid (\d+)", start.stdout)
  module = mine("bertjax.pretrain").split(".")[0]
  copy = bucket / "logs" / f"{os.uname().nodename}.log"
  try:
    assert start.returncode == 0 and found, start.stderr
    log = home / "bertjax-logs" / "train.log"
    assert wait_for(lambda: "args" in log.read_text())
    assert f"args {['--config=configs/bert_large.py', f'--workdir={bucket}', *EXTRA]}" in log.read_text()
    again = bash(mine(tpu_remote.run_script(plan)), env)
    assert again.returncode != 0 and "training is running; stop it first" in again.stderr
    check = tpu_remote.parse_workers(bash(mine(tpu_remote.check_script()), env).stdout)
    assert [(w.state, w.alive) for w in check.values()] == [("running", True)]
    assert any("args" in line for line in list(check.values())[0].tail)
    assert wait_for(lambda: copy.exists() and "args" in copy.read_text())  # while it runs
    stop = bash(mine(tpu_remote.stop_script(30)), env)
    assert stop.returncode == 0 and "saved and exited" in stop.stdout, stop.stderr
    assert "SIGTERM: saved" in log.read_text()
    assert wait_for(lambda: (home / "bertjax-logs" / "train.exit").exists())
    (worker,) = tpu_remote.parse_workers(bash(mine(tpu_remote.check_script()), env).stdout).values()
    assert worker.state == "exited:0" and worker.finished and not worker.alive
    assert wait_for(lambda: copy.read_text() == log.read_text())  # the copy after the exit
    idle = bash(mine(tpu_remote.stop_script(30)), env)
    assert idle.returncode == 0 and "no training process" in idle.stdout
  finally:
    kill_if_mine(module)


def test_check_reports_a_worker_that_died_on_a_stand_in_worker(tmp_path):
  home, env, mine = stand_in_worker(tmp_path, "import sys\nsys.exit('ImportError: no flax here')\n")
  plan = tpu_remote.RunPlan("configs/tiny.py", str(tmp_path / "w"), [], [])
  start = bash(mine(tpu_remote.run_script(plan, sync_every=0)), env)
  assert start.returncode == 0, start.stderr
  assert wait_for(lambda: (home / "bertjax-logs" / "train.exit").exists())
  (worker,) = tpu_remote.parse_workers(bash(mine(tpu_remote.check_script()), env).stdout).values()
  assert worker.state == "exited:1" and not worker.alive and not worker.finished
  assert worker.tail[-1] == "ImportError: no flax here"
  assert not (tmp_path / "w" / "logs").exists()  # sync_every=0: no copier


def test_readme_dry_run_output_is_the_launchers():
  """launch/README.md shows a dry run's output: it must stay what the launcher prints."""
  readme = (REPO / "launch" / "README.md").read_text()
  section = readme.split("## 3. Dry run", 1)[1].split("\n## ", 1)[0]
  command, shown = re.findall(r"```(?:bash|text)\n(.*?)```", section, re.S)[:2]
  argv = shlex.split(command.replace("\\\n", " "))
  assert argv[:3] == ["python", "-m", "launch.tpu"] and "--dry-run" in argv
  r = launch(*argv[3:], env={**os.environ, "TMPDIR": "/tmp"})
  assert r.returncode == 0, r.stderr
  assert r.stdout == shown
