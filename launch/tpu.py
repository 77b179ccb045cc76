"""Pre-train on a Cloud TPU slice: create it, set it up, run, check, follow, stop, delete.

  python -m launch.tpu up --name=bert-large --zone=ZONE --accelerator-type=v5p-128 --spot --watch \\
      --config=configs/bert_large.py --workdir=gs://BUCKET/large_p1 \\
      -- --config.data.cache_dir=gs://BUCKET/bertjax-cache
  python -m launch.tpu status --name=bert-large     # later commands need only the name

Subcommands: create (a queued resource, waits until ACTIVE), setup (project + venv + the locked
packages of launch/requirements-tpu.lock on every worker), run (pre-flight on every worker, then
bertjax.pretrain in the background with a log per worker copied to WORKDIR/logs, then a check of
every worker after --check-after seconds), status, logs (--worker=N|all), stop (SIGTERM: the loop
saves a checkpoint and exits), delete (collects the logs first), and up (create unless it exists
+ setup + run + logs; --watch recreates a preempted Spot slice and restarts the job). Every
command is printed before it runs; --dry-run prints them and runs nothing (no subprocess at all).
Flags after `--` go to `python -m bertjax.pretrain` unchanged. The inputs are checked before anything
is created: the accelerator type, a gs:// workdir and shared data for multi-host jobs, the
config's mesh against the slice (ICI) and the slices (DCN). `SUBCOMMAND --help` lists a
subcommand's flags. See launch/README.md.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # `python launch/tpu.py`: `launch` not importable
  sys.exit("launch/tpu.py is a module of the `launch` package: run `python -m launch.tpu ...` "
           "from the project's root, or `launch/tpu.sh ...` from anywhere.")

# pylint: disable=wrong-import-position
import json
import os
import subprocess
import tempfile

from bertjax import versions
from launch import tpu_flags
from launch.tpu_cloud import (FAILED, GOING, MISSING, PREEMPTED, READY, LaunchError, Runner,
                              create_argv, delete_argv, describe, events_path, forget,
                              save_state, scp, ssh, state_path, wait_until)
from launch.tpu_plan import PYTHON_REQUIREMENT, REPO, from_setup_py, parse_accelerator, plan_run
from launch.tpu_remote import (REMOTE_LOG, REMOTE_TARBALL, VERSIONS, RunPlan, check_script,
                               collect_script, follow_script, kill_script, logs_dir,
                               parse_host_versions, parse_workers, preflight_script, run_script,
                               setup_script, stop_script, version_problems)

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
                      + "; delete it (python -m launch.tpu delete) and run up again")
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
    raise LaunchError("no worker reported its versions (is it set up? python -m launch.tpu setup)")
  compiled = None
  if args.aot_report:
    with open(args.aot_report, encoding="utf-8") as f:
      compiled = versions.parse_versions(json.load(f).get("versions", ""))
    if not compiled:
      raise LaunchError(f"{args.aot_report} names no versions: make it with this bertjax.aot")
  problems = version_problems(per_host, versions.read_lock(), compiled)
  if problems:
    raise LaunchError("refusing to start: " + "; ".join(problems) + ". `python -m launch.tpu setup` "
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
  runner.say(f"run: on {where}, python -m bertjax.pretrain in the background, log {REMOTE_LOG}"
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
        + ". Their last log lines are above (all of them: python -m launch.tpu logs --worker=all). "
        f"The others wait for them: python -m launch.tpu stop --kill --name={args.name}, fix, run "
        "again")
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
                          f"python -m launch.tpu logs --name={args.name} --worker=all")
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
  me = "python -m launch.tpu"
  runner.say(f"later: `{me} status --name={args.name}`; `{me} logs --name={args.name} "
             f"--worker=all`; `{me} stop --name={args.name}` (saves a checkpoint); `{me} delete "
             f"--name={args.name}` (collects the logs, deletes the slice; the workdir stays)")
  logs(args, runner)


SUBCOMMANDS = {  # name: what runs it (its flags and help: launch/tpu_flags.py)
    "create": create,
    "setup": setup,
    "run": run,
    "status": status,
    "logs": logs,
    "stop": stop,
    "delete": delete,
    "up": up,
}


def main(argv: list[str] | None = None) -> int:
  args = tpu_flags.parse(list(sys.argv[1:] if argv is None else argv), __doc__)
  if args.command == "up":  # up follows every worker: one that dies is seen at once
    args.worker, args.node = "all", "all"
  runner = Runner(args.dry_run)
  if args.dry_run:
    runner.say("dry run: the commands are printed, none is run")
  try:
    tpu_flags.complete(args)
    SUBCOMMANDS[args.command](args, runner)
  except LaunchError as err:
    print(f"{tpu_flags.PROG} {args.command}: error: {err}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("\ninterrupted (a queued resource that was requested stays requested: "
          "python -m launch.tpu delete removes it)", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
