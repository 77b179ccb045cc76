"""`python -m launch.tpu`'s command line: each subcommand's flags (gcloud's dashed spelling), its
--help, and the arguments it runs with, completed from the slice's record (launch/tpu_cloud.py).
The subcommands themselves are launch/tpu.py's."""

from __future__ import annotations

import sys
import types

from absl import flags

from bertjax import cli
from bertjax.parallel import topologies
from launch.tpu_cloud import LaunchError, fill_from_state, state_path

PROG = "launch.tpu"  # how its messages name it, as bertjax's commands name themselves (cli.program)

GENERATIONS = {g.name: g.runtime_version for g in topologies.GENERATIONS.values()}


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
FLAGS_OF = {  # subcommand: its flags
    "create": COMMON + SLICE,
    "setup": COMMON + PROJECT,
    "run": COMMON + JOB + ("lines", "accelerator-type"),
    "status": COMMON + ("lines",),
    "logs": COMMON + ("worker", "node"),
    "stop": COMMON + ("wait-seconds", "kill"),
    "delete": COMMON + ("no-collect-logs",),
    "up": COMMON + SLICE + PROJECT + JOB + ("lines", "watch", "watch-seconds", "max-restarts"),
}
ABOUT = {  # subcommand: what it does
    "create": "request the slice (a queued resource) and wait until ACTIVE",
    "setup": "project, venv, the locked packages on every worker",
    "run": ("pre-flight, then python -m bertjax.pretrain on every worker in the background "
            "(nohup), a log on each copied to the workdir, then a check of every worker"),
    "status": ("the resource's state and every worker's: running, exited:STATUS, vanished, "
               "not-started; with its log's last lines"),
    "logs": "follow a worker's log, or every worker's (--worker=all)",
    "stop": ("SIGTERM to the job on every worker (pkill -f of bertjax.pretrain): the loop saves "
             "a checkpoint at its next logging step and exits; `run` with the same --workdir "
             "resumes"),
    "delete": ("copy every worker's log to WORKDIR/logs, then delete the queued resource and its"
               " TPU VMs (--force --quiet); the workdir stays"),
    "up": ("create (unless it exists) + setup + run + logs; every input is checked before "
           "anything is created"),
}


def flag_values(command: str | None) -> flags.FlagValues:
  """A FlagValues holding `command`'s flags (every subcommand's for None)."""
  names = FLAGS_OF[command] if command else list(FLAG_SPECS)
  values = flags.FlagValues()
  for name in names:
    define, default, text = FLAG_SPECS[name]
    define(name, default, text, flag_values=values)
  if command:
    flags.mark_flag_as_required("name", flag_values=values)
  if "spot" in names:
    flags.mark_bool_flags_as_mutual_exclusive(["spot", "reserved"], flag_values=values)
  return values


def usage(command: str | None, values: flags.FlagValues, overview: str) -> str:
  """--help's text: `overview` (the command's docstring) and every subcommand's flags, or one
  subcommand's."""
  if command is None:
    return (overview + "\nSubcommands:\n" + "".join(
        f"  {name}: {text}\n" for name, text in ABOUT.items())
            + "\nEvery subcommand's flags:\n" + values.get_help(include_special_flags=False))
  return (f"{PROG} {command}: {ABOUT[command]}.\n\nFlags after `--` go to python -m "
          f"bertjax.pretrain (run, up).\n\n{values.get_help(include_special_flags=False)}")


def parse(argv: list[str], overview: str) -> types.SimpleNamespace:
  """The command line (after the program's name) as the subcommands read it: one attribute per
  flag of the subcommand (dashes as underscores), `command`, and `flags` (those after `--`). A
  command line that cannot run ends the process (exit status 2); --help prints and exits 0."""
  job_flags = []
  if "--" in argv:
    i = argv.index("--")
    argv, job_flags = argv[:i], argv[i + 1:]
  asks_help = any(a in cli.HELP_FLAGS or a == "-h" for a in argv)
  command = None if argv[:1] == ["-h"] else cli.subcommand([PROG, *argv], list(FLAGS_OF), PROG)
  values = flag_values(command)
  if asks_help:
    print(usage(command, values, overview))
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
      name.replace("-", "_"): values[name].value for name in FLAGS_OF[command]})
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
