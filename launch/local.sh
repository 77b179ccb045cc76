#!/usr/bin/env bash
# A pod on one machine: N processes of `python -m bertjax.pretrain` that join one global mesh.
# Usage and options: launch/local.sh -h.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local.sh [-n N] [-d D] [-p PORT] [--python PY] [-m MODULE] -- FLAGS...

Runs N processes of `python -m bertjax.pretrain` on this machine as the hosts of a pod: each sees D
emulated CPU devices, and together they form one global mesh of N x D devices (collectives over
gloo, process 0 coordinating on 127.0.0.1:PORT). Every flag after `--` goes to each process
unchanged; the launcher adds --coordinator_address, --num_processes and --process_id itself.

  -n N         processes (default 2); with 1, a plain single-process run on D devices
  -d D         emulated CPU devices per process (default 4)
  -p PORT      coordinator port (default: a free port)
  --python PY  interpreter (default: $PYTHON, else .venv/bin/python of this checkout, else python3)
  -m MODULE    the command each process runs (default bertjax.pretrain; bertjax.finetune for a
               fine-tuning pod)
  -h, --help   this text

Output: each line of process i's stdout and stderr is prefixed with "[i] ".
Exit status: 0 when every process exits 0; otherwise the first failure's status, and the
launcher stops the other processes at once (they would wait forever in a collective for the
failed one). A process that hangs instead (SIGSTOP, a wedged host) is named by another's
watchdog after train.watchdog_seconds (300 s by default), which ends its own process with status
75; the launcher then stops the rest. Ctrl-C or SIGTERM is passed on to every process: the
training loop saves a checkpoint and exits 0, so running the same command again resumes. A second
Ctrl-C kills them.

Example (8 devices in 2 processes; then resume the same run on 1 process):
  launch/local.sh -n 2 -d 4 -- --config=configs/tiny.py --workdir=/tmp/pod
  python -m bertjax.pretrain --config=configs/tiny.py --workdir=/tmp/pod
EOF
}

die_usage() {
  echo "launch/local.sh: $*" >&2
  echo "Try 'launch/local.sh -h'." >&2
  exit 2
}

# fd 3: the launcher's own messages, still shown while bash's job reports on fd 2 are silenced.
exec 3>&2
log() { echo "[local.sh] $*" >&3; }

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
num_processes=2
devices=4
port=""
python=${PYTHON:-}
module=bertjax.pretrain
saw_dashdash=0
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    -n | -d | -p | -m | --python)
      (($# >= 2)) || die_usage "option $1 needs a value"
      case $1 in
        -n) num_processes=$2 ;;
        -d) devices=$2 ;;
        -p) port=$2 ;;
        --python) python=$2 ;;
        -m) module=$2 ;;
      esac
      shift 2 ;;
    --) shift; saw_dashdash=1; break ;;
    *)
      for arg in "$@"; do [[ $arg == -- ]] && die_usage "unknown option '$1'"; done
      die_usage "missing '--' before the flags of bertjax.pretrain ('$1'), e.g." \
        "launch/local.sh -n 2 -- --config=configs/tiny.py --workdir=/tmp/pod" ;;
  esac
done

((saw_dashdash)) || die_usage "missing '--' before the flags of bertjax.pretrain, e.g." \
  "launch/local.sh -n 2 -- --config=configs/tiny.py --workdir=/tmp/pod"
(($#)) || die_usage "no flags after '--': give at least --config and --workdir"
is_uint "$num_processes" && ((10#$num_processes >= 1)) ||
  die_usage "-n $num_processes: the number of processes must be an integer >= 1"
is_uint "$devices" && ((10#$devices >= 1)) ||
  die_usage "-d $devices: the devices per process must be an integer >= 1"
num_processes=$((10#$num_processes))
devices=$((10#$devices))
if [[ -n $port ]]; then
  is_uint "$port" && ((10#$port >= 1 && 10#$port <= 65535)) ||
    die_usage "-p $port: the port must be an integer in [1, 65535]"
fi
for flag in "$@"; do
  case $flag in
    --coordinator_address* | --num_processes* | --process_id*)
      die_usage "'$flag': the launcher sets the coordinator, process count and ids itself" ;;
  esac
done

if [[ -z $python ]]; then
  if [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi
command -v "$python" >/dev/null || die_usage "python interpreter '$python' not found"

distributed=()
if ((num_processes > 1)); then
  if [[ -z $port ]]; then
    # Bound on every interface, as the coordination service binds; the port could in theory be
    # taken before process 0 binds it: then process 0 fails and -p PORT picks another.
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  fi
  distributed=(--coordinator_address="127.0.0.1:$port" --num_processes="$num_processes")
fi

# The device count is this launcher's to set (pytest, for one, exports 8); other XLA flags stay.
xla_flags=""
read -r -a inherited <<<"${XLA_FLAGS:-}"
for f in ${inherited[@]+"${inherited[@]}"}; do
  case $f in --xla_force_host_platform_device_count=*) ;; *) xla_flags+="$f " ;; esac
done
xla_flags+="--xla_force_host_platform_device_count=$devices"

fifos=$(mktemp -d "${TMPDIR:-/tmp}/bertjax-local.XXXXXX")
pids=()       # bertjax.pretrain of process i; each leads its own process group
alive=()      # 1 while process i has not been reaped
prefixers=()  # the awk that prefixes process i's lines
stopping=""   # the signal passed on, once Ctrl-C / SIGTERM arrived
failed=""     # index of the first process that failed

kill_all() {  # $1: signal; to whole groups, so helpers a process forked go too
  local i
  for ((i = 0; i < num_processes; i++)); do
    if [[ ${alive[i]:-0} == 1 ]]; then kill "-$1" -- "-${pids[i]}" 2>/dev/null || true; fi
  done
}

on_signal() {
  if [[ -n $stopping ]]; then
    log "$1 again: killing every process"
    kill_all KILL
    return
  fi
  stopping=$1
  log "$1: passed on to every process (they save a checkpoint and exit; again to kill them)"
  kill_all "$1"
}

cleanup() {
  # Whatever ends the launcher (an error here included) must not leave hosts waiting on each other.
  kill_all KILL
  rm -rf "$fifos"
}

trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal TERM' HUP
trap cleanup EXIT

log "$num_processes process(es) x $devices CPU device(s)${port:+, coordinator 127.0.0.1:$port}: $python -m $module $*"
for ((i = 0; i < num_processes; i++)); do
  mkfifo "$fifos/$i"
  # The prefixer stays in the launcher's process group, where a terminal's Ctrl-C lands: it must
  # survive that and print the processes' last words (the checkpoint they save). One write per
  # line, so the lines of different processes interleave whole. Bash's `read` takes a pipe a line
  # at a time; awk would not do here: mawk (Debian's awk) reads a FIFO in blocks and holds a
  # sparse log's lines back until its buffer fills or the process exits.
  (
    trap '' INT TERM HUP
    while IFS= read -r line || [[ -n $line ]]; do
      printf '[%s] %s\n' "$i" "$line"
    done <"$fifos/$i" 3>&-
  ) &
  prefixers+=("$!")
  ids=()
  ((num_processes > 1)) && ids=(--process_id="$i")
  # Job control on: each process gets a process group of its own, away from the terminal's, so a
  # Ctrl-C reaches it once (forwarded) and the group can be killed with all it started.
  set -m
  # XLA's CPU scratch memory on huge pages unless the caller chose otherwise (bertjax/hostmem.py).
  JAX_PLATFORMS=cpu XLA_FLAGS=$xla_flags PYTHONUNBUFFERED=1 \
    GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1} \
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m "$module" "$@" ${distributed[@]+"${distributed[@]}"} \
    ${ids[@]+"${ids[@]}"} <"/dev/null" >"$fifos/$i" 2>&1 3>&- &
  pids+=("$!")
  alive+=(1)
  set +m
done

# Polling rather than `wait -n`: works on the bash 3.2 of macOS too, and a quarter second is
# nothing next to the seconds a process takes to start. Stderr is silenced around it because
# bash reports each killed job there with its whole command line; our own messages say it better.
status=0
running=$num_processes
while ((running > 0)); do
  for ((i = 0; i < num_processes; i++)); do
    [[ ${alive[i]} == 1 ]] && ! kill -0 "${pids[i]}" 2>/dev/null || continue
    rc=0
    wait "${pids[i]}" || rc=$?
    alive[i]=0
    running=$((running - 1))
    ((rc == 0)) && continue
    # The group may still hold what the process started.
    kill -KILL -- "-${pids[i]}" 2>/dev/null || true
    if [[ -z $failed ]]; then
      failed=$i
      status=$rc
      if ((running > 0)); then
        log "process $i exited with status $rc: stopping the other $running"
        kill_all KILL
      else
        log "process $i exited with status $rc"
      fi
    fi
  done
  ((running > 0)) && sleep 0.25
done 2>/dev/null

# Let the prefixers print everything the processes wrote before the launcher returns.
wait ${prefixers[@]+"${prefixers[@]}"} 2>/dev/null || true
if [[ -n $failed ]]; then
  log "failed: process $failed exited with status $status"
else
  log "all $num_processes process(es) exited 0"
fi
exit "$status"
