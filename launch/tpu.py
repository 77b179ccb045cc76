#!/usr/bin/env python3
"""Pre-train on a Cloud TPU slice: create it, set it up, run, check, follow, stop, delete.

  python launch/tpu.py up --name=bert-large --zone=ZONE --accelerator-type=v5p-128 --spot --watch \\
      --config=configs/bert_large.py --workdir=gs://BUCKET/large_p1 \\
      -- --config.data.cache_dir=gs://BUCKET/bertjax-cache
  python launch/tpu.py status --name=bert-large     # later commands need only the name

Subcommands: create (a queued resource, waits until ACTIVE), setup (project + venv + the locked
packages of launch/requirements-tpu.lock on every worker), run (pre-flight on every worker, then
bertjax.main in the background with a log per worker copied to WORKDIR/logs, then a check of
every worker after --check-after seconds), status, logs (--worker=N|all), stop (SIGTERM: the loop
saves a checkpoint and exits), delete (collects the logs first), and up (create unless it exists
+ setup + run + logs; --watch recreates a preempted Spot slice and restarts the job). Every
command is printed before it runs; --dry-run prints them and runs nothing (no subprocess at all).
Flags after `--` go to `python -m bertjax.main` unchanged. The inputs are checked before anything
is created: the accelerator type, a gs:// workdir and shared data for multi-host jobs, the
config's mesh against the slice (ICI) and the slices (DCN). See launch/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tpu_* modules beside this
# pylint: disable=wrong-import-position
# Some names are imported only to be found here (the tests read tpu.check_mesh, tpu.run_script...).
from tpu_cloud import (FAILED, GOING, MISSING, PREEMPTED, READY, LaunchError, Runner, create_argv,
                       delete_argv, describe, events_path, fill_from_state, forget, save_state,
                       scp, ssh, state_path, wait_until)
from tpu_plan import (MESH_AXES, PYTHON_REQUIREMENT, REPO, Accelerator, check_mesh,  # noqa: F401
                      config_overrides, from_setup_py, parse_accelerator, plan_run)
from tpu_remote import (REMOTE_LOG, REMOTE_TARBALL, TRAINING_PROCESS, VERSIONS,  # noqa: F401
                        RunPlan,
                        check_script, collect_script, follow_script, kill_script, logs_dir,
                        parse_host_versions, parse_workers, preflight_script, run_script,
                        setup_script, stop_script, version_problems)
from bertjax import topologies, versions  # noqa: E402  (REPO is on sys.path: tpu_plan)

GENERATIONS = {g.name: g.runtime_version for g in topologies.GENERATIONS.values()}


def create(args, runner: Runner) -> None:
  accel = parse_accelerator(args.accelerator_type)
  runtime = args.runtime_version or accel.runtime_version
  slices = f"{args.num_slices} slices of " if args.num_slices > 1 else ""
  tier = "spot" if args.spot else "reserved" if args.reserved else "on-demand"
  runner.say(f"create: {slices}{accel.describe()}; runtime {runtime}; {tier}")
  save_state(args, runner)  # first: a create cut short still leaves what `delete` needs
  runner.run(create_argv(args, accel, runtime))
  wait_until(args, runner)


def ensure_slice(args, runner: Runner) -> None:
  """`up`: uses the resource if it is there (waiting for it if it is queued), recreates one that
  Spot preemption suspended, creates one otherwise."""
  parse_accelerator(args.accelerator_type)  # before any command
  state, message = describe(args, runner, missing_in_dry_run=True)
  if state == MISSING:
    create(args, runner)
    return
  runner.say(f"{args.name} exists: {state}" + (f" ({message})" if message else ""))
  save_state(args, runner)
  if state == READY:
    runner.say("up: skips create")
  elif state in PREEMPTED or state in GOING:
    if state in PREEMPTED:
      runner.run(delete_argv(args))
    wait_until(args, runner, until=(MISSING,), through=GOING)
    create(args, runner)
  elif state in FAILED:
    raise LaunchError(f"queued resource {args.name} is {state}" + (f": {message}" if message else "")
                      + "; delete it (launch/tpu.py delete) and run up again")
  else:
    wait_until(args, runner)


def setup(args, runner: Runner) -> None:
  python_version = args.python or from_setup_py(PYTHON_REQUIREMENT, "3.11")
  source = f"git clone {args.repo}" + (f" @ {args.ref}" if args.ref else "") if args.repo else (
      f"git archive of {args.ref or 'HEAD'} (committed files only)")
  runner.say(f"setup: on every worker: project from {source}, venv with Python {python_version}, "
             "pip install -r launch/requirements-tpu.lock -e .[tpu] (the exact versions)")
  save_state(args, runner)
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
  runner.run(ssh(args, setup_script(args.repo, args.ref, python_version)))


def plan_from_args(args) -> RunPlan:
  if not args.config or not args.workdir:
    raise LaunchError(f"no job: give --config and --workdir (none recorded for {args.name} in "
                      f"{state_path(args.name)})")
  accel = parse_accelerator(args.accelerator_type) if args.accelerator_type else None
  plan = plan_run(args.config, args.workdir, args.flags, accel, args.num_slices)
  for warning in plan.warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  return plan


def check_versions(args, runner: Runner, text: str) -> None:
  """Refuses a start on workers whose packages differ from each other, the lock, or the AOT
  report given."""
  if runner.dry_run:
    runner.say("(dry run: the workers' versions are compared with the lock when this runs)")
    return
  per_host = parse_host_versions(text)
  if not per_host:
    raise LaunchError("no worker reported its versions (is it set up? launch/tpu.py setup)")
  compiled = None
  if args.aot_report:
    with open(args.aot_report, encoding="utf-8") as f:
      compiled = versions.parse_versions(json.load(f).get("versions", ""))
    if not compiled:
      raise LaunchError(f"{args.aot_report} names no versions: make it with this bertjax.aot")
  problems = version_problems(per_host, versions.read_lock(), compiled)
  if problems:
    raise LaunchError("refusing to start: " + "; ".join(problems) + ". `launch/tpu.py setup` "
                      "installs launch/requirements-tpu.lock on every worker" + (
                          f"; compile again with the lock's versions (pip install -r "
                          f"launch/requirements-tpu.lock) for a new {args.aot_report}"
                          if compiled else ""))
  runner.say(f"versions: {len(per_host)} workers, all as launch/requirements-tpu.lock"
             + (f" and {args.aot_report}" if compiled else ""))


def check_workers(args, runner: Runner, quiet: bool = False, every_tail: bool = False):
  """Every worker's state, and the last lines of the log of each that is not running (of every
  one with every_tail), prefixed by its host."""
  _, out, _ = runner.run(ssh(args, check_script(args.lines)), capture=True, quiet=quiet)
  workers = parse_workers(out)
  for w in workers.values():
    if every_tail or not (w.alive or w.finished):
      print(f"worker {w.host}: {w.state}", flush=True)
      for line in w.tail:
        print(f"  {w.host}| {line}", flush=True)
  counts = {}
  for w in workers.values():
    counts[w.state] = counts.get(w.state, 0) + 1
  if workers:
    print(f"{len(workers)} workers: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
          flush=True)
  return workers


def run(args, runner: Runner, plan: RunPlan | None = None) -> None:
  plan = plan or plan_from_args(args)
  save_state(args, runner)
  where = f"every worker of {args.num_slices} slices" if args.num_slices > 1 else "every worker"
  if args.skip_preflight:
    runner.say(f"pre-flight on {where}: versions only (--skip-preflight: nothing stopped)")
  else:
    runner.say(f"pre-flight on {where}: stop what holds the TPU, remove a stale libtpu lock "
               "file, report the installed versions")
  _, out, _ = runner.run(ssh(args, preflight_script(clean=not args.skip_preflight)), capture=True)
  sys.stdout.writelines(l for l in out.splitlines(keepends=True) if not l.startswith(VERSIONS))
  check_versions(args, runner, out)
  runner.say(f"run: on {where}, python -m bertjax.main in the background, log {REMOTE_LOG}"
             + (f", copied to {logs_dir(plan.workdir)}/HOSTNAME.log every "
                f"{args.sync_logs_every:g} s" if args.sync_logs_every > 0 else "")
             + ("; the multi-slice coordinator and slice ids come from the queued resource's "
                "TPU metadata (read by jax.distributed)" if args.num_slices > 1 else ""))
  runner.run(ssh(args, run_script(plan, args.sync_logs_every)))
  runner.say(f"check: every worker after {args.check_after:g} s (--check-after): a worker that "
             "died (import error, out of memory, a busy TPU) fails the run here")
  if not runner.dry_run:
    runner.sleep(args.check_after)
  workers = check_workers(args, runner)
  if runner.dry_run:
    return
  dead = [w for w in workers.values() if not w.alive and not w.finished]
  expected = parse_accelerator(args.accelerator_type).hosts if args.accelerator_type else None
  expected = expected * args.num_slices if expected else None
  if dead or not workers or (expected and len(workers) < expected):
    named = ", ".join(f"{w.host} ({w.state})" for w in dead) or "none"
    raise LaunchError(
        f"not running after {args.check_after:g} s: {named}" + (
            f"; {len(workers)} of {expected} workers answered" if expected else "")
        + ". Their last log lines are above (all of them: launch/tpu.py logs --worker=all). The "
        f"others wait for them: launch/tpu.py stop --kill --name={args.name}, fix, run again")
  finished = sum(w.finished for w in workers.values())
  runner.say(f"all {len(workers)} workers running" + (f" or finished ({finished} exited with "
                                                       "status 0)" if finished else ""))


def status(args, runner: Runner) -> None:
  state, message = describe(args, runner)
  print(f"{args.name}: {state}" + (f" ({message})" if message else ""), flush=True)
  if state == READY or runner.dry_run:
    check_workers(args, runner, every_tail=True)


def logs(args, runner: Runner) -> None:
  every = args.worker == "all"
  who = "every worker's" if every else f"worker {args.worker}'s (slice {args.node})"
  runner.say(f"logs: {who} {REMOTE_LOG} (Ctrl-C stops following; the job goes on)"
             + (f"; copies in {logs_dir(args.workdir)}" if args.workdir else ""))
  runner.run(ssh(args, follow_script(every), worker=args.worker, node="all" if every else args.node))


def stop(args, runner: Runner) -> None:
  if args.kill:
    runner.say("stop --kill: SIGKILL to the training process on every worker (no checkpoint)")
    runner.run(ssh(args, kill_script()))
    return
  runner.say("stop: SIGTERM to the training process on every worker; it saves a checkpoint at "
             "its next logging step and exits")
  runner.run(ssh(args, stop_script(args.wait_seconds)))


def delete(args, runner: Runner) -> None:
  if args.workdir and not args.no_collect_logs:
    runner.say(f"delete: first each worker's log to {logs_dir(args.workdir)} (if they answer)")
    rc, out, err = runner.run(ssh(args, collect_script(args.workdir)), capture=True, check=False)
    sys.stdout.write(out)
    if rc:
      runner.say(f"warning: the logs were not all collected (exit status {rc}: "
                 f"{(err.strip().splitlines() or [''])[-1]}); deleting anyway")
  elif not args.no_collect_logs:
    runner.say(f"delete: no workdir recorded for {args.name}: the logs are not collected")
  runner.say(f"delete: the queued resource {args.name} and its TPU VMs (the workdir stays)")
  runner.run(delete_argv(args))
  forget(args.name, runner)


def watch(args, runner: Runner, plan: RunPlan) -> None:
  """Until the job ends: on Spot preemption, delete, recreate, set up and restart the same job,
  which resumes from its checkpoint in the workdir; at most --max-restarts times."""
  log = events_path(args.name)
  runner.event(f"watch {args.name}: every {args.watch_seconds:g} s; on preemption recreate and "
               f"restart (at most {args.max_restarts} times); events in {log}", log)
  restarts = 0
  while True:
    if runner.dry_run:
      describe(args, runner)
      check_workers(args, runner)
      return
    runner.sleep(args.watch_seconds)
    state, message = describe(args, runner, quiet=True)
    if state == READY:
      workers = check_workers(args, runner, quiet=True)
      if workers and all(w.finished for w in workers.values()):
        runner.event(f"{args.name}: the job finished on all {len(workers)} workers", log)
        return
      dead = [w for w in workers.values() if not w.alive and not w.finished]
      if not dead:
        continue
      runner.event(f"{args.name}: not running: {', '.join(w.host + ' ' + w.state for w in dead)};"
                   " preempted?", log)
      runner.sleep(args.poll_seconds)  # a preempted slice leaves ACTIVE soon after its VMs go
      state, message = describe(args, runner, quiet=True)
      if state == READY:
        runner.event(f"{args.name}: still ACTIVE: a failure of the job, not a preemption; "
                     "watch ends", log)
        raise LaunchError(f"workers died on an ACTIVE slice: {', '.join(w.host for w in dead)}; "
                          f"launch/tpu.py logs --name={args.name} --worker=all")
    if state in PREEMPTED:
      restarts += 1
      if restarts > args.max_restarts:
        runner.event(f"{args.name}: {state} again; {args.max_restarts} restarts done, watch ends",
                     log)
        raise LaunchError(f"{args.name} preempted {restarts} times (--max-restarts="
                          f"{args.max_restarts}); the workdir {args.workdir} keeps the checkpoints")
      runner.event(f"{args.name}: {state}" + (f" ({message})" if message else "")
                   + f": delete, recreate, set up, restart ({restarts}/{args.max_restarts})", log)
      runner.run(delete_argv(args))
      create(args, runner)
      runner.event(f"{args.name}: ACTIVE again", log)
      setup(args, runner)
      run(args, runner, plan)
      runner.event(f"{args.name}: restarted with the same flags", log)
    elif state != READY:
      runner.event(f"{args.name}: {state}" + (f" ({message})" if message else "") + "; watch ends",
                   log)
      raise LaunchError(f"queued resource {args.name} is {state}" + (
          f": {message}" if message else "") + " (not a preemption: not recreated)")


def up(args, runner: Runner) -> None:
  plan = plan_from_args(args)  # every input checked before a slice is paid for
  ensure_slice(args, runner)
  setup(args, runner)
  run(args, runner, plan)
  if args.watch:
    watch(args, runner, plan)
    return
  me = f"python {os.path.relpath(os.path.abspath(__file__))}"
  runner.say(f"later: `{me} status --name={args.name}`; `{me} logs --name={args.name} "
             f"--worker=all`; `{me} stop --name={args.name}` (saves a checkpoint); `{me} delete "
             f"--name={args.name}` (collects the logs, deletes the slice; the workdir stays)")
  logs(args, runner)


# --- Command line. ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--name", required=True, help="queued resource (and TPU node) name")
  common.add_argument("--zone", help="e.g. us-east5-a (where the quota is); remembered")
  common.add_argument("--project", help="Google Cloud project (default: gcloud's); remembered")
  common.add_argument("--num-slices", type=int, help="slices of a multi-slice job (queued "
                      "resource nodes; default 1); remembered")
  common.add_argument("--dry-run", action="store_true",
                      help="print every command, run none (no subprocess at all)")
  common.add_argument("--poll-seconds", type=float, default=30, help="describe every N s while "
                      "waiting")
  common.add_argument("--max-wait", type=float, default=0, help="give up waiting for a state "
                      "after N s (0: no limit; a queued Spot request can wait for hours)")
  slice_ = argparse.ArgumentParser(add_help=False)
  slice_.add_argument("--accelerator-type", help="v5p-128, v5p-384, v5litepod-64, v6e-256, v4-32")
  slice_.add_argument("--runtime-version", help="default: the one for the generation "
                      f"({', '.join(f'{g}: {r}' for g, r in GENERATIONS.items())})")
  tier = slice_.add_mutually_exclusive_group()
  tier.add_argument("--spot", action="store_true", help="Spot VMs: cheaper, preemptible")
  tier.add_argument("--reserved", action="store_true", help="the project's reserved capacity")
  slice_.add_argument("--extra-create-flags", action="append", metavar="FLAGS",
                      help="more flags for `queued-resources create`, split as a shell would "
                      "and passed verbatim, e.g. \"--network=N --subnetwork=S --internal-ips "
                      "--service-account=SA --reservation=R\"; repeatable; remembered")
  project = argparse.ArgumentParser(add_help=False)
  project.add_argument("--repo", help="git URL cloned on each worker (default: a git archive of "
                       "this checkout, copied with scp)")
  project.add_argument("--ref", help="commit, branch or tag (default: HEAD / the default branch)")
  project.add_argument("--python", help="Python for the venv (default: setup.py's python_requires)")
  job = argparse.ArgumentParser(add_help=False)
  job.add_argument("--config", help="e.g. configs/bert_large.py or ...:phase=2 (with --workdir and "
                   "the flags after --, remembered: a later `run` may leave all three out)")
  job.add_argument("--workdir", help="gs://BUCKET/RUN: checkpoints, logs, metrics; the same one "
                   "resumes")
  job.add_argument("--check-after", type=float, default=120, help="seconds after the start to "
                   "check that every worker still runs (default 120)")
  job.add_argument("--skip-preflight", action="store_true", help="stop nothing that holds the TPU "
                   "and keep /tmp/libtpu_lockfile (the versions are still compared)")
  job.add_argument("--aot-report", help="the --json of `python -m bertjax.aot`: the workers' "
                   "versions must also be the ones it compiled with")
  job.add_argument("--sync-logs-every", type=float, default=60, help="copy each worker's log to "
                   "WORKDIR/logs/HOSTNAME.log every N s and at the job's exit (0: never)")
  lines = argparse.ArgumentParser(add_help=False)
  lines.add_argument("--lines", type=int, default=20, help="log lines shown per worker")

  p = argparse.ArgumentParser(
      prog="launch/tpu.py", description=__doc__.split("\n\n")[0],
      epilog="Flags after `--` go to python -m bertjax.main (e.g. -- --config.data.cache_dir=gs://B/c).")
  sub = p.add_subparsers(dest="command", required=True)

  def add(name, parents, text):
    return sub.add_parser(name, parents=parents, help=text, description=text)

  add("create", [common, slice_], "request the slice (a queued resource) and wait until ACTIVE")
  add("setup", [common, project], "project, venv, the locked packages on every worker")
  r = add("run", [common, job, lines], "pre-flight, then python -m bertjax.main on every worker "
          "in the background (nohup), a log on each copied to the workdir, then a check of every "
          "worker")
  r.add_argument("--accelerator-type", help="the slice's type, for the checks (remembered from "
                 "create; without it the slice is taken as multi-host)")
  add("status", [common, lines], "the resource's state and every worker's: running, "
      "exited:STATUS, vanished, not-started; with its log's last lines")
  g = add("logs", [common], "follow a worker's log, or every worker's (--worker=all)")
  g.add_argument("--worker", default="0", help="N or all (default 0)")
  g.add_argument("--node", default="0", help="the slice of --worker=N (multi-slice; default 0)")
  s = add("stop", [common], "SIGTERM to the job on every worker (pkill -f of bertjax.main): the "
          "loop saves a checkpoint at its next logging step and exits; `run` with the same "
          "--workdir resumes")
  s.add_argument("--wait-seconds", type=int, default=600, help="wait this long for the save")
  s.add_argument("--kill", action="store_true", help="SIGKILL instead, no checkpoint: for a job "
                 "that SIGTERM cannot stop (e.g. hosts blocked in a collective after one failed)")
  d = add("delete", [common], "copy every worker's log to WORKDIR/logs, then delete the queued "
          "resource and its TPU VMs (--force --quiet); the workdir stays")
  d.add_argument("--no-collect-logs", action="store_true", help="delete without copying the logs")
  u = add("up", [common, slice_, project, job, lines], "create (unless it exists) + setup + run + "
          "logs; every input is checked before anything is created")
  u.add_argument("--watch", action="store_true", help="instead of following the log, watch the "
                 "slice: on Spot preemption delete, recreate, set up and restart the job (it "
                 "resumes from its checkpoint); ends when the job does")
  u.add_argument("--watch-seconds", type=float, default=300, help="with --watch: look every N s")
  u.add_argument("--max-restarts", type=int, default=5, help="with --watch: recreate at most N "
                 "times")
  return p


COMMANDS = {"create": create, "setup": setup, "run": run, "status": status, "logs": logs,
            "stop": stop, "delete": delete, "up": up}


def complete(args, p: argparse.ArgumentParser) -> None:
  """Fills what was left out from the resource's record, then the defaults; refuses what is
  still missing."""
  given = {k for k, v in vars(args).items() if v not in (None, False, [])}
  job_given = bool({"config", "workdir"} & given or args.flags)
  if job_given:  # a job is given whole, or taken whole from the record
    given |= {"config", "workdir", "flags"}
  fill_from_state(args, given)
  if args.num_slices is None:  # not `or 1`: a --num-slices=0 given is refused, not made 1
    args.num_slices = 1
  if args.num_slices < 1:
    p.error(f"--num-slices={args.num_slices} must be at least 1")
  if not args.zone:
    raise LaunchError(f"--zone is needed: nothing is recorded for {args.name} "
                      f"({state_path(args.name)})")
  if args.command in ("create", "up") and not args.accelerator_type:
    raise LaunchError("--accelerator-type is needed (e.g. v5p-128)")


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
  args.flags = flags
  for key in ("accelerator_type", "config", "workdir", "extra_create_flags", "repo", "ref",
              "runtime_version", "spot", "reserved"):
    setattr(args, key, getattr(args, key, None))
  if args.command == "up":  # up follows every worker: one that dies is seen at once
    args.worker, args.node = "all", "all"
  runner = Runner(args.dry_run)
  if args.dry_run:
    runner.say("dry run: the commands are printed, none is run")
  try:
    complete(args, p)
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
