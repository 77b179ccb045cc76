#!/bin/sh
# launch/tpu.py with the project's venv when there is one (its config checks load configs/*.py).
d=$(dirname "$0"); py="$d/../.venv/bin/python"; [ -x "$py" ] || py=python3
exec "$py" "$d/tpu.py" "$@"
