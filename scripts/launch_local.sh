#!/usr/bin/env bash
# Starts N processes on 127.0.0.1, each with K CPU devices, joined with jax.distributed (CPU collectives).
#   scripts/launch_local.sh -n 2 -d 4 -- python -m megajax.train --config configs/tiny.yaml
# Each line of output is prefixed with its process rank. If any process fails, the others are killed and
# the launcher exits with that process's status. --pin binds process i to CPU core i (taskset).
set -uo pipefail

usage() { echo "usage: $0 -n NUM_PROCESSES [-d CPU_DEVICES_PER_PROCESS] [-p PORT] [--pin] -- COMMAND..." >&2; exit 2; }
n=""; d=1; port=""; pin=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n="$2"; shift 2 ;;
    -d) d="$2"; shift 2 ;;
    -p) port="$2"; shift 2 ;;
    --pin) pin=1; shift ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ -n "$n" ] && [ $# -gt 0 ] || usage
if [ -z "$port" ]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

pids=()
cleanup() {
  for pid in "${pids[@]}"; do pkill -TERM -P "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null; done
}
trap 'cleanup; exit 130' INT TERM

for ((i = 0; i < n; i++)); do
  prefix=()
  [ "$pin" = 1 ] && prefix=(taskset -c "$((i % $(nproc)))")
  (
    export MEGAJAX_COORDINATOR="127.0.0.1:$port" MEGAJAX_NUM_PROCESSES="$n" MEGAJAX_PROCESS_ID="$i"
    export MEGAJAX_CPU_DEVICES="$d" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
    "${prefix[@]}" "$@" 2>&1 | sed -u "s/^/[$i] /"
    exit "${PIPESTATUS[0]}"
  ) &
  pids+=($!)
done

status=0
remaining=$n
while [ "$remaining" -gt 0 ]; do
  wait -n -p done_pid
  rc=$?
  remaining=$((remaining - 1))
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "[launcher] process (pid $done_pid) exited with $rc: stopping the others" >&2
    cleanup
  fi
done
exit "$status"
