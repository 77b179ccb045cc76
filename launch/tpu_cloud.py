"""gcloud for launch/tpu.py: printing and running commands, the queued resource's state, and the
launcher's memory of each resource (a small JSON file per name).

Every command on the workers goes through `gcloud compute tpus queued-resources ssh|scp
--node=all`, one slice or several: a later subcommand needs only the name.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time


class LaunchError(Exception):
  """Bad input or a failed command: printed as one clear line, exit status non-zero."""


# Queued resource states (TPU API QueuedResourceState): waiting ones, and where waiting ends.
READY = "ACTIVE"
PREEMPTED = ("SUSPENDING", "SUSPENDED", "PREEMPTED")  # Spot capacity taken back: recreate
FAILED = ("FAILED",)
GOING = ("DELETING",)
MISSING = "NOT_FOUND"


class Runner:
  """Prints each command (`+ ...`, copy-pasteable) and runs it unless this is a dry run."""

  def __init__(self, dry_run: bool, sleep=time.sleep):
    self.dry_run = dry_run
    self.sleep = sleep

  def say(self, text: str) -> None:
    print(f"# {text}", flush=True)

  def event(self, text: str, log_path: str | None = None) -> None:
    """A line with the time, printed and (outside dry runs) appended to the resource's log."""
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}"
    print(f"# {line}", flush=True)
    if log_path and not self.dry_run:
      os.makedirs(os.path.dirname(log_path), exist_ok=True)
      with open(log_path, "a", encoding="utf-8") as f:
        f.write(line + "\n")

  def run(self, argv: list[str], capture: bool = False, quiet: bool = False,
          check: bool = True) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); stdout and stderr are returned only with capture (else
    they go to the terminal). check: a non-zero status raises LaunchError."""
    if not quiet:
      print("+ " + shlex.join(argv), flush=True)
    if self.dry_run:
      return 0, "", ""
    pipe = subprocess.PIPE if capture else None
    try:
      done = subprocess.run(argv, check=False, text=True, stdout=pipe, stderr=pipe)
    except FileNotFoundError:
      raise LaunchError(f"{argv[0]} not found on PATH" + (
          ": install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)"
          if argv[0] == "gcloud" else "")) from None
    if check and done.returncode:
      detail = (done.stderr or "").strip().splitlines()[-3:] if capture else []
      raise LaunchError(f"exit status {done.returncode}: {shlex.join(argv)}"
                        + ("\n" + "\n".join(detail) if detail else ""))
    return done.returncode, done.stdout or "", done.stderr or ""


# --- What the launcher remembers of each resource. ----------------------------------------------

# Kept from the first command that names them; a later one may leave them out.
REMEMBERED = ("zone", "project", "num_slices", "accelerator_type", "runtime_version", "spot",
              "reserved", "extra_create_flags", "workdir", "config", "flags", "repo", "ref")


def state_dir() -> str:
  return os.environ.get("BERTJAX_TPU_STATE") or os.path.join(
      os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "bertjax", "tpu")


def state_path(name: str) -> str:
  return os.path.join(state_dir(), f"{name}.json")


def events_path(name: str) -> str:
  return os.path.join(state_dir(), f"{name}.events.log")


def load_state(name: str) -> dict:
  try:
    with open(state_path(name), encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as err:
    raise LaunchError(f"{state_path(name)} is unreadable ({err}); delete it and pass every flag") \
        from None


def save_state(args, runner: Runner, **extra) -> None:
  """Records the resource's settings (not in a dry run: it changes nothing)."""
  record = {**load_state(args.name), **{k: getattr(args, k) for k in REMEMBERED
                                        if getattr(args, k, None) not in (None, False, [])}}
  record.update(extra)
  if runner.dry_run:
    return
  os.makedirs(state_dir(), exist_ok=True)
  tmp = state_path(args.name) + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(tmp, state_path(args.name))


def forget(name: str, runner: Runner) -> None:
  if not runner.dry_run and os.path.exists(state_path(name)):
    os.remove(state_path(name))


def fill_from_state(args, given: set[str]) -> dict:
  """Fills the flags left out from what was recorded for args.name; a flag given wins, except a
  different --num-slices, which would mean another resource."""
  record = load_state(args.name)
  if {"spot", "reserved"} & given:  # one tier given replaces the one recorded
    given = given | {"spot", "reserved"}
  for key in REMEMBERED:
    if key in record and key not in given:
      setattr(args, key, record[key])
  if "num_slices" in given and record.get("num_slices", args.num_slices) != args.num_slices:
    raise LaunchError(f"--num-slices={args.num_slices}, but {args.name} was created with "
                      f"{record['num_slices']} slices ({state_path(args.name)}); leave the flag "
                      "out, or delete the resource first")
  return record


# --- gcloud commands. ----------------------------------------------------------------------------

QR = ["gcloud", "compute", "tpus", "queued-resources"]


def location(args) -> list[str]:
  return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def ssh(args, script: str, worker: str = "all", node: str = "all") -> list[str]:
  """Runs `script` on the workers of every slice (or one worker of one slice)."""
  return QR + ["ssh", args.name, f"--node={node}", f"--worker={worker}"] + location(args) + [
      f"--command={script}"]


def scp(args, local: str, remote: str) -> list[str]:
  return QR + ["scp", local, f"{args.name}:{remote}", "--node=all", "--worker=all"] + location(args)


def create_argv(args, accel, runtime: str) -> list[str]:
  argv = QR + ["create", args.name]
  if args.num_slices > 1:
    argv += [f"--node-count={args.num_slices}", f"--node-prefix={args.name}"]
  else:
    argv += [f"--node-id={args.name}"]
  argv += [f"--accelerator-type={accel.name}", f"--runtime-version={runtime}"] + location(args)
  argv += ["--spot"] if args.spot else ["--reserved"] if args.reserved else []
  for extra in args.extra_create_flags or []:  # verbatim, as the shell would split them
    argv += shlex.split(extra)
  return argv


def delete_argv(args) -> list[str]:
  return QR + ["delete", args.name, "--force", "--quiet"] + location(args)


def describe_argv(args) -> list[str]:
  return QR + ["describe", args.name] + location(args) + ["--format=json(state)"]


def read_state(stdout: str) -> tuple[str, str]:
  """(state, what the API says about it) from `describe --format=json(state)`."""
  text = stdout.strip()
  try:
    data = json.loads(text)
  except ValueError:
    return (text.split()[0] if text else "UNKNOWN"), ""
  state = data.get("state", {}) if isinstance(data, dict) else {}
  name = state.get("state", "UNKNOWN") if isinstance(state, dict) else str(state)
  details = {k: v for k, v in state.items() if k != "state"} if isinstance(state, dict) else {}
  failed = details.get("failedData", {}).get("error", {}).get("message")
  return name, failed or (json.dumps(details, sort_keys=True) if details else "")


def describe(args, runner: Runner, quiet: bool = False, retries: int = 5,
             missing_in_dry_run: bool = False) -> tuple[str, str]:
  """The queued resource's (state, message); (NOT_FOUND, "") when there is none. A failing
  describe (network, API hiccup) is retried `retries` times before it counts. A dry run
  answers ACTIVE, or NOT_FOUND where the caller would create it (so that it prints create)."""
  for attempt in range(retries + 1):
    rc, out, err = runner.run(describe_argv(args), capture=True, quiet=quiet, check=False)
    if runner.dry_run:
      return (MISSING if missing_in_dry_run else READY), ""
    if rc == 0:
      return read_state(out)
    if "NOT_FOUND" in err or "not found" in err.lower():
      return MISSING, ""
    last = (err.strip().splitlines() or [f"exit status {rc}"])[-1]
    if attempt < retries:
      runner.say(f"describe failed ({last}); retrying in {args.poll_seconds} s "
                 f"({attempt + 1}/{retries})")
      runner.sleep(args.poll_seconds)
      quiet = True
  raise LaunchError(f"describe failed {retries + 1} times in a row, last: {last}")


def wait_until(args, runner: Runner, until=(READY,), through=()) -> str:
  """Polls until the state is one of `until` (NOT_FOUND counts when in `until`), waiting through
  the queue's states (WAITING_FOR_RESOURCES, PROVISIONING, ...) and `through`. Raises on FAILED,
  DELETING, SUSPENDED and the like, with the state's message, or after --max-wait seconds."""
  runner.say(f"wait until {' or '.join(until)}: describe every {args.poll_seconds:g} s (printed "
             "once)" + (f", at most {args.max_wait:g} s" if args.max_wait else ""))
  terminal = set(FAILED + GOING + PREEMPTED + (MISSING,)) - set(until) - set(through)
  start, last = time.monotonic(), None
  while True:
    state, message = describe(args, runner, quiet=last is not None)
    waited = time.monotonic() - start
    if state != last and not runner.dry_run:
      runner.say(f"{args.name}: {state} after {waited / 60:.0f} min")
    if runner.dry_run or state in until:
      return state
    last = state
    if state in terminal:
      raise LaunchError(f"queued resource {args.name} is {state}" + (f": {message}" if message else "")
                        + f"; see `{shlex.join(describe_argv(args)[:-1])}`" + (
                            ", then delete it (python -m launch.tpu delete) and create again"
                            if state != MISSING else ""))
    if args.max_wait and waited >= args.max_wait:
      raise LaunchError(f"queued resource {args.name} is still {state} after {args.max_wait:g} s "
                        "(--max-wait); it stays requested: python -m launch.tpu delete removes it")
    runner.sleep(args.poll_seconds)
