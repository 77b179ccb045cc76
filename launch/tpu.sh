#!/bin/sh
# python -m launch.tpu from anywhere: with the project's venv when there is one (its config checks
# load configs/*.py), and the project's folder on PYTHONPATH (where `launch` and `configs` are).
d=$(cd "$(dirname "$0")/.." && pwd); py="$d/.venv/bin/python"; [ -x "$py" ] || py=python3
PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m launch.tpu "$@"
