"""The Apache Beam driver of preparation (`config.data.prepare_engine="beam"`): the same two steps
as the local driver (shards.py), spread by Beam over its workers, with the same bytes out.

  python -m bertjax.data.prepare --config=configs/base.py --config.data.prepare_engine=beam \
    --config.data.beam_pipeline_options="runner=DataflowRunner,project=P,region=R,..."

Options pass through as TFDS passes them: comma-separated key=value pairs, each becoming
`--key=value` for Beam. Without a runner (or with runner=DirectRunner) the pipeline runs here on
Beam's FnApiRunner (what the DirectRunner runs batch pipelines on) in `prepare_workers` worker
processes (direct_running_mode=multi_processing): offline, where the DirectRunner would first try
the Prism runner, whose binary is downloaded.

The pipeline: pieces of input -> scatter_unit (each piece once, in any order) -> a barrier (every
piece read) -> the build task of every shard not yet built -> build_shard. Each task writes its
files whole under temporary names and renames them, so a retried or repeated bundle (Dataflow
retries a failed one up to four times) rewrites the same bytes; the manifest is written by the
caller, from the files, once the pipeline is done.
"""

import contextlib
import importlib
import io
import logging
import os
import re
import sys
import tempfile

from bertjax import cli
from bertjax.data.preparation import shards
from bertjax.errors import Refusal

# An exception's line of a worker's traceback, inside the error Beam raises, with the step Beam
# appends: one of bertjax's (bertjax.errors.Refusal, ...) or a builtin (FileNotFoundError, ...).
_RAISED = re.compile(r"^((?:bertjax\.[\w.]+\.)?[A-Z]\w*): (.+?)(?: \[while running '[^']*'\])?$",
                     re.M)
_STEP = re.compile(r" \[while running '[^']*'\]$")
_FIX = ("write comma-separated key=value pairs, e.g. 'runner=DataflowRunner,project=my-project,"
        "region=us-central1', or leave it empty to run here")


# The runners that run the pipeline here (Beam's FnApiRunner, which the DirectRunner runs batch
# pipelines on); None: no runner named.
LOCAL_RUNNERS = (None, "DirectRunner", "direct", "FnApiRunner")


def _args(spec: str) -> dict[str, str]:
  """`beam_pipeline_options` ("k=v,k2=v2") as Beam's flags by name, refusing an item that is not
  key=value."""
  args = {}
  for item in filter(None, (x.strip() for x in spec.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise Refusal(f"config.data.beam_pipeline_options: {item!r} is not key=value; {_FIX}.")
    args[key.lstrip("-")] = value
  return args


def runs_here(spec: str) -> bool:
  """Whether `beam_pipeline_options` runs the pipeline on this machine (no other runner named)."""
  return _args(spec).get("runner") in LOCAL_RUNNERS


def pipeline_options(spec: str, num_workers: int):
  """Beam's options from `beam_pipeline_options` ("k=v,k2=v2"); local ones when no other runner.
  An option Beam cannot parse is refused naming the config key, without Beam's usage text."""
  args = [f"--{k}={v}" for k, v in _args(spec).items()]
  options = _parsed(args, spec)
  if is_local(options):
    given = set(options.get_all_options(drop_default=True))
    defaults = {"direct_num_workers": num_workers, "direct_running_mode": "multi_processing"}
    options = _parsed(args + [f"--{k}={v}" for k, v in defaults.items() if k not in given], spec)
  return options


def _parsed(args: list[str], spec: str):
  """PipelineOptions(args), parsed now: Beam parses them with argparse, which prints its usage
  (about 120 lines) and exits on a value of the wrong type; here its one complaint is kept."""
  from apache_beam.options.pipeline_options import PipelineOptions  # lazy: the `beam` extra
  options = PipelineOptions(args)
  usage = io.StringIO()
  try:
    with contextlib.redirect_stderr(usage):
      options.get_all_options()
  except SystemExit:
    said = usage.getvalue().strip().splitlines()[-1:] or ["?"]
    raise Refusal(f"config.data.beam_pipeline_options={spec!r}: Beam refuses it "
                  f"({said[0].partition('error: ')[2] or said[0]}): give that option a value "
                  f"of its kind, or leave it out.") from None
  return options


def is_local(options) -> bool:
  from apache_beam.options.pipeline_options import StandardOptions  # lazy: the `beam` extra
  return options.view_as(StandardOptions).runner in LOCAL_RUNNERS


def pipeline_of(spec: str, num_workers: int):
  """The Beam pipeline `beam_pipeline_options` asks for: on the runner it names, or here on
  Beam's FnApiRunner. A runner Beam does not know is refused naming the config key."""
  import apache_beam as beam  # lazy: apache-beam is the optional `beam` extra
  options = pipeline_options(spec, num_workers)
  if is_local(options):
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner  # lazy: the extra
    return beam.Pipeline(runner=FnApiRunner(), options=options)
  try:
    return beam.Pipeline(options=options)
  except ValueError as err:  # Beam's "Unexpected pipeline runner: X. Valid values are ..."
    raise Refusal(f"config.data.beam_pipeline_options={spec!r}: {err} Name one of those as "
                  "runner=, or none to run here.") from None


def worker_refusal(err: BaseException) -> Exception | None:
  """The refusal of the input (what `cli.one_line` says in one line) a worker raised, from the
  error Beam raised for it, its message alone without Beam's step; None when `err` holds none (a
  plain ValueError, a fault of the code, is none). Beam's in-memory runner raises the worker's
  exception itself, its step appended; the multi-process one, its traceback as text."""
  if cli.one_line(err) is not None:
    message = _STEP.sub("", str(err))
    return err if message == str(err) else type(err)(message)
  for name, message in reversed(_RAISED.findall(str(err))):
    module, _, attr = name.rpartition(".")
    try:
      raised = getattr(importlib.import_module(module or "builtins"), attr)(message)
    except Exception:  # pylint: disable=broad-except  (no such class, or not of one message)
      continue
    if isinstance(raised, BaseException) and cli.one_line(raised) is not None:
      return raised
  return None


@contextlib.contextmanager
def _stderr_into(held):
  """fd 2 into the file `held` (None: left alone): this process's stderr and that of the worker
  processes Beam's local runner starts, which inherit it."""
  if held is None:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  os.dup2(held.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def _scatter(task: dict, data) -> dict:
  marker = shards.scatter_unit(task, data)
  return {"unit": marker["unit"], "documents": marker["corpus"]["documents"]}


def run(data, out_dir: str, todo: list[dict], steps, num_workers: int):
  """Reads the pieces `todo` names and builds the shards not yet built, on Beam. `steps` is the
  local driver's `(build_tasks_after(scattered), build(task))` (bertjax/data/prepare.py): the
  same functions, pickled by reference into Beam's workers, so the bytes are the same.

  A refusal of the input raised in a worker is raised here as the worker raised it, so the
  command says it in one line. On the local runner, Beam's own output (its workers' logs and
  tracebacks, 200 lines and more for one refusal) is held until the pipeline ends, then shown,
  unless it ended on a refusal, which says all of it."""
  logging.info("Beam: reading %d piece(s) of input, then building the shards not yet built, in "
               "%s.", len(todo), out_dir)
  # Held from Beam's import on (a warning of its own, where Google Cloud's libraries are absent).
  with tempfile.TemporaryFile() if runs_here(data.beam_pipeline_options) else (
      contextlib.nullcontext()) as held:
    try:
      with _stderr_into(held):
        _run_pipeline(pipeline_of(data.beam_pipeline_options, num_workers), todo, data, steps)
    except Exception as err:  # pylint: disable=broad-except
      if (refused := worker_refusal(err)) is not None:
        raise refused from None
      _show(held)
      raise
    _show(held)


def _show(held) -> None:
  """Writes what `_stderr_into` held (if anything) to stderr."""
  if held is not None:
    held.seek(0)
    sys.stderr.write(held.read().decode("utf-8", "replace"))
    sys.stderr.flush()


def _run_pipeline(pipeline, todo, data, steps):
  import apache_beam as beam  # lazy: apache-beam is the optional `beam` extra
  build_tasks_after, build = steps
  with pipeline as p:
    _ = (p
         | "pieces" >> beam.Create(todo)
         # Spreads the pieces over the workers (Create alone may give them to one bundle).
         | "spread pieces" >> beam.Reshuffle()
         | "scatter" >> beam.Map(_scatter, data)
         | "all read" >> beam.combiners.ToList()
         | "shard tasks" >> beam.FlatMap(build_tasks_after)
         | "spread shards" >> beam.Reshuffle()
         | "build" >> beam.Map(build))
