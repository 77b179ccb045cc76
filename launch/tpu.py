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
import types

from absl import flags

from bertjax import cli, topologies, versions
from launch.tpu_cloud import (FAILED, GOING, MISSING, PREEMPTED, READY, LaunchError, Runner,
                              create_argv, delete_argv, describe, events_path, fill_from_state,
                              forget, save_state, scp, ssh, state_path, wait_until)
from launch.tpu_plan import PYTHON_REQUIREMENT, REPO, from_setup_py, parse_accelerator, plan_run
from launch.tpu_remote import (REMOTE_LOG, REMOTE_TARBALL, VERSIONS, RunPlan, check_script,
                               collect_script, follow_script, kill_script, logs_dir,
                               parse_host_versions, parse_workers, preflight_script, run_script,
                               setup_script, stop_script, version_problems)

PROG = "launch.tpu"  # how its messages name it, as bertjax's commands name themselves (cli.program)

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


# --- Command line. ---------------------------------------------------------------------------------
# Each subcommand defines only its own flags, in a FlagValues made per call: absl then refuses
# another subcommand's flag by name, `SUBCOMMAND --help` lists the subcommand's, and `main` runs
# any number of times in one process (tests/test_launch_tpu_ops.py drives it with a fake gcloud)
# without meeting absl's global FLAGS or another command's --config. The flags keep gcloud's
# dashed spelling (--accelerator-type, --num-slices), which absl accepts.

_S, _I, _F, _B, _M = (flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float,
                      flags.DEFINE_bool, flags.DEFINE_multi_string)
FLAG_SPECS = {  # name: (define, default, help)
    "name": (_S, None, "queued resource (and TPU node) name"),
    "zone": (_S, None, "e.g. us-east5-a (where the quota is); remembered"),
    "project": (_S, None, "Google Cloud project (default: gcloud's); remembered"),
    "num-slices": (_I, None, "slices of a multi-slice job (queued resource nodes; default 1); "
                   "remembered"),
    "dry-run": (_B, False, "print every command, run none (no subprocess at all)"),
    "poll-seconds": (_F, 30, "describe every N s while waiting"),
    "max-wait": (_F, 0, "give up waiting for a state after N s (0: no limit; a queued Spot "
                 "request can wait for hours)"),
    "accelerator-type": (_S, None, "v5p-128, v5p-384, v5litepod-64, v6e-256, v4-32; for `run`, "
                         "the slice's type for the checks (remembered from create; without it "
                         "the slice is taken as multi-host)"),
    "runtime-version": (_S, None, "default: the one for the generation (" + ", ".join(
        f"{g}: {r}" for g, r in GENERATIONS.items()) + ")"),
    "spot": (_B, False, "Spot VMs: cheaper, preemptible"),
    "reserved": (_B, False, "the project's reserved capacity"),
    "extra-create-flags": (_M, None, "more flags for `queued-resources create`, split as a shell "
                           "would and passed verbatim, e.g. \"--network=N --subnetwork=S "
                           "--internal-ips --service-account=SA --reservation=R\"; repeatable; "
                           "remembered"),
    "repo": (_S, None, "git URL cloned on each worker (default: a git archive of this checkout, "
             "copied with scp)"),
    "ref": (_S, None, "commit, branch or tag (default: HEAD / the default branch)"),
    "python": (_S, None, "Python for the venv (default: setup.py's python_requires)"),
    "config": (_S, None, "e.g. configs/bert_large.py or ...:phase=2 (with --workdir and the flags "
               "after --, remembered: a later `run` may leave all three out)"),
    "workdir": (_S, None, "gs://BUCKET/RUN: checkpoints, logs, metrics; the same one resumes"),
    "check-after": (_F, 120, "seconds after the start to check that every worker still runs"),
    "skip-preflight": (_B, False, "stop nothing that holds the TPU and keep /tmp/libtpu_lockfile "
                       "(the versions are still compared)"),
    "aot-report": (_S, None, "the --json of `python -m bertjax.aot`: the workers' versions must "
                   "also be the ones it compiled with"),
    "sync-logs-every": (_F, 60, "copy each worker's log to WORKDIR/logs/HOSTNAME.log every N s "
                        "and at the job's exit (0: never)"),
    "lines": (_I, 20, "log lines shown per worker"),
    "worker": (_S, "0", "N or all"),
    "node": (_S, "0", "the slice of --worker=N (multi-slice)"),
    "wait-seconds": (_I, 600, "wait this long for the save"),
    "kill": (_B, False, "SIGKILL instead, no checkpoint: for a job that SIGTERM cannot stop (e.g. "
             "hosts blocked in a collective after one failed)"),
    "no-collect-logs": (_B, False, "delete without copying the logs"),
    "watch": (_B, False, "instead of following the log, watch the slice: on Spot preemption "
              "delete, recreate, set up and restart the job (it resumes from its checkpoint); "
              "ends when the job does"),
    "watch-seconds": (_F, 300, "with --watch: look every N s"),
    "max-restarts": (_I, 5, "with --watch: recreate at most N times"),
}
COMMON = ("name", "zone", "project", "num-slices", "dry-run", "poll-seconds", "max-wait")
SLICE = ("accelerator-type", "runtime-version", "spot", "reserved", "extra-create-flags")
PROJECT = ("repo", "ref", "python")
JOB = ("config", "workdir", "check-after", "skip-preflight", "aot-report", "sync-logs-every")
SUBCOMMANDS = {  # name: (function, its flags, what it does)
    "create": (create, COMMON + SLICE, "request the slice (a queued resource) and wait until "
               "ACTIVE"),
    "setup": (setup, COMMON + PROJECT, "project, venv, the locked packages on every worker"),
    "run": (run, COMMON + JOB + ("lines", "accelerator-type"), "pre-flight, then python -m "
            "bertjax.pretrain on every worker in the background (nohup), a log on each copied to the "
            "workdir, then a check of every worker"),
    "status": (status, COMMON + ("lines",), "the resource's state and every worker's: running, "
               "exited:STATUS, vanished, not-started; with its log's last lines"),
    "logs": (logs, COMMON + ("worker", "node"), "follow a worker's log, or every worker's "
             "(--worker=all)"),
    "stop": (stop, COMMON + ("wait-seconds", "kill"), "SIGTERM to the job on every worker (pkill "
             "-f of bertjax.pretrain): the loop saves a checkpoint at its next logging step and exits; "
             "`run` with the same --workdir resumes"),
    "delete": (delete, COMMON + ("no-collect-logs",), "copy every worker's log to WORKDIR/logs, "
               "then delete the queued resource and its TPU VMs (--force --quiet); the workdir "
               "stays"),
    "up": (up, COMMON + SLICE + PROJECT + JOB + ("lines", "watch", "watch-seconds",
                                                "max-restarts"),
           "create (unless it exists) + setup + run + logs; every input is checked before "
           "anything is created"),
}


def flag_values(command: str | None) -> flags.FlagValues:
  """A FlagValues holding `command`'s flags (every subcommand's for None)."""
  names = SUBCOMMANDS[command][1] if command else list(FLAG_SPECS)
  values = flags.FlagValues()
  for name in names:
    define, default, text = FLAG_SPECS[name]
    define(name, default, text, flag_values=values)
  if command:
    flags.mark_flag_as_required("name", flag_values=values)
  if "spot" in names:
    flags.mark_bool_flags_as_mutual_exclusive(["spot", "reserved"], flag_values=values)
  return values


def usage(command: str | None, values: flags.FlagValues) -> str:
  if command is None:
    return (__doc__ + "\nSubcommands:\n" + "".join(
        f"  {name}: {text}\n" for name, (_, _, text) in SUBCOMMANDS.items())
            + "\nEvery subcommand's flags:\n" + values.get_help(include_special_flags=False))
  return (f"{PROG} {command}: {SUBCOMMANDS[command][2]}.\n\nFlags after `--` go to python -m "
          f"bertjax.pretrain (run, up).\n\n{values.get_help(include_special_flags=False)}")


def parse(argv: list[str]) -> types.SimpleNamespace:
  """The command line (after the program's name) as the subcommands read it: one attribute per
  flag of the subcommand (dashes as underscores), `command`, and `flags` (those after `--`). A
  command line that cannot run ends the process (exit status 2); --help prints and exits 0."""
  job_flags = []
  if "--" in argv:
    i = argv.index("--")
    argv, job_flags = argv[:i], argv[i + 1:]
  asks_help = any(a in cli.HELP_FLAGS or a == "-h" for a in argv)
  command = None if argv[:1] == ["-h"] else cli.subcommand([PROG, *argv], list(SUBCOMMANDS), PROG)
  values = flag_values(command)
  if asks_help:
    print(usage(command, values))
    sys.exit(0)
  prog = f"{PROG} {command}"
  try:
    rest = values([prog, *argv[1:]])
  except flags.Error as err:
    cli.usage_error(str(err), prog)
  if rest[1:]:
    cli.usage_error(f"unexpected arguments {rest[1:]}", prog)
  if job_flags and command not in ("run", "up"):
    cli.usage_error(f"flags after -- are for bertjax.pretrain; `{command}` takes none", prog)
  args = types.SimpleNamespace(command=command, flags=job_flags, **{
      name.replace("-", "_"): values[name].value for name in SUBCOMMANDS[command][1]})
  for key in ("accelerator_type", "config", "workdir", "extra_create_flags", "repo", "ref",
              "runtime_version", "spot", "reserved"):
    setattr(args, key, getattr(args, key, None))
  return args


def complete(args) -> None:
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
    cli.usage_error(f"--num-slices={args.num_slices} must be at least 1", f"{PROG} {args.command}")
  if not args.zone:
    raise LaunchError(f"--zone is needed: nothing is recorded for {args.name} "
                      f"({state_path(args.name)})")
  if args.command in ("create", "up") and not args.accelerator_type:
    raise LaunchError("--accelerator-type is needed (e.g. v5p-128)")


def main(argv: list[str] | None = None) -> int:
  args = parse(list(sys.argv[1:] if argv is None else argv))
  if args.command == "up":  # up follows every worker: one that dies is seen at once
    args.worker, args.node = "all", "all"
  runner = Runner(args.dry_run)
  if args.dry_run:
    runner.say("dry run: the commands are printed, none is run")
  try:
    complete(args)
    SUBCOMMANDS[args.command][0](args, runner)
  except LaunchError as err:
    print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("\ninterrupted (a queued resource that was requested stays requested: "
          "python -m launch.tpu delete removes it)", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
