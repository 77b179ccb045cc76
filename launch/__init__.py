"""Cloud TPU pod scripts (queued resources) and a local multi-process launcher (local.sh).

Run the launcher as a module from the project's root, `python -m launch.tpu ...`, or as
`launch/tpu.sh ...` from anywhere (the project's venv, the project on PYTHONPATH): its checks
import `bertjax` and `configs`, which sit beside this package.
"""
