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

import logging
import re

from bertjax.data import shards
from bertjax.errors import Refusal

# How a worker's refusal of the input reads inside the error Beam raises: the exception's line of
# the worker's traceback, with the step Beam appends.
_REFUSAL = re.compile(r"^((?:bertjax\.errors\.)?Refusal|ValueError|FileNotFoundError): "
                      r"(.+?)(?: \[while running '[^']*'\])?$", re.M)


def pipeline_options(spec: str, num_workers: int):
  """Beam's options from `beam_pipeline_options` ("k=v,k2=v2"); local ones when no other runner."""
  from apache_beam.options.pipeline_options import PipelineOptions  # lazy: the `beam` extra
  args = []
  for item in filter(None, (x.strip() for x in spec.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise Refusal(f"config.data.beam_pipeline_options: {item!r} is not key=value; write "
                    f"e.g. 'runner=DataflowRunner,project=my-project,region=us-central1'.")
    args.append(f"--{key.lstrip('-')}={value}")
  options = PipelineOptions(args)
  if is_local(options):
    given = set(options.get_all_options(drop_default=True))
    defaults = {"direct_num_workers": num_workers, "direct_running_mode": "multi_processing"}
    options = PipelineOptions(args + [f"--{k}={v}" for k, v in defaults.items() if k not in given])
  return options


def is_local(options) -> bool:
  from apache_beam.options.pipeline_options import StandardOptions  # lazy: the `beam` extra
  runner = options.view_as(StandardOptions).runner
  return runner in (None, "DirectRunner", "direct", "FnApiRunner")


def _scatter(task: dict, data) -> dict:
  marker = shards.scatter_unit(task, data)
  return {"unit": marker["unit"], "documents": marker["corpus"]["documents"]}


def run(data, out_dir: str, todo: list[dict], steps, num_workers: int):
  """Reads the pieces `todo` names and builds the shards not yet built, on Beam. `steps` is the
  local driver's `(build_tasks_after(scattered), build(task))` (bertjax/data/prepare.py): the
  same functions, pickled by reference into Beam's workers, so the bytes are the same."""
  import apache_beam as beam  # lazy: apache-beam is the optional `beam` extra
  options = pipeline_options(data.beam_pipeline_options, num_workers)
  runner = None
  if is_local(options):
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner  # lazy: the extra
    runner = FnApiRunner()
  logging.info("Beam: reading %d piece(s) of input, then building the shards not yet built, in "
               "%s.", len(todo), out_dir)
  try:
    _run_pipeline(beam.Pipeline(runner=runner, options=options), todo, data, steps)
  except Exception as err:  # pylint: disable=broad-except
    # A refusal of the input in a worker reaches here inside Beam's own error, traceback and all:
    # said as the local driver says it (one line, its type, so the commands report it alone).
    found = _REFUSAL.findall(str(err))
    if not found or isinstance(err, (ValueError, FileNotFoundError)):
      raise
    kind, message = found[-1]
    raise (FileNotFoundError if kind == "FileNotFoundError" else Refusal)(message) from None


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
