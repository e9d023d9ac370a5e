#!/usr/bin/env bash
# Starts N processes on 127.0.0.1, each with K CPU devices, joined with jax.distributed (CPU collectives).
#   scripts/launch_local.sh -n 2 -d 4 -- python -m megajax.train --config configs/tiny.yaml
# Each line of output is prefixed with its process rank. SIGTERM or SIGINT (Ctrl-C) to the launcher is passed on
# to every process, and the launcher waits while they agree on a step, save one checkpoint and exit. If a process
# fails, the others get SIGTERM and, after MEGAJAX_LAUNCH_GRACE seconds (default 10), SIGKILL (a process left in a
# collective with a dead peer never returns from it); the launcher exits with the failed process's status.
# --pin binds process i to CPU core i (taskset).
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
grace="${MEGAJAX_LAUNCH_GRACE:-10}"

pids=(); printers=(); declare -A rank_of
for ((i = 0; i < n; i++)); do
  prefix=()
  [ "$pin" = 1 ] && prefix=(taskset -c "$((i % $(nproc)))")
  # The rank prefixer reads a pipe of its own, outside the process's signal path: it ends when the process has
  # closed its output, so nothing the process prints is lost, however it ends.
  exec {out}> >(trap '' INT TERM; sed -u "s/^/[$i] /")
  printers+=($!)
  (
    export MEGAJAX_COORDINATOR="127.0.0.1:$port" MEGAJAX_NUM_PROCESSES="$n" MEGAJAX_PROCESS_ID="$i"
    export MEGAJAX_CPU_DEVICES="$d" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
    exec "${prefix[@]}" "$@"
  ) >&"$out" 2>&1 &
  pids+=($!); rank_of[$!]=$i
  exec {out}>&-
done

pass_on() {  # a stop request: every process saves at the step they agree on and exits
  echo "[launcher] $1: passing it on to the processes; waiting for their checkpoint" >&2
  kill -TERM "${pids[@]}" 2>/dev/null
}
trap 'pass_on SIGTERM' TERM
trap 'pass_on SIGINT' INT

end_the_rest() {  # SIGTERM now, SIGKILL after the grace period, to whatever is still running
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((t = 0; t < grace * 10; t++)); do
    kill -0 "${pids[@]}" 2>/dev/null || return
    sleep 0.1
  done
  echo "[launcher] still running after ${grace} s: SIGKILL" >&2
  kill -KILL "${pids[@]}" 2>/dev/null
}

status=0
declare -A running
for pid in "${pids[@]}"; do running[$pid]=1; done
while [ "${#running[@]}" -gt 0 ]; do
  done_pid=""
  wait -n -p done_pid "${!running[@]}"
  rc=$?
  [ -n "${done_pid:-}" ] || continue  # a signal interrupted the wait (it was passed on)
  unset "running[$done_pid]"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "[launcher] process ${rank_of[$done_pid]} (pid $done_pid) exited with $rc: stopping the others" >&2
    end_the_rest &
  fi
done
wait "${printers[@]}" 2>/dev/null
exit "$status"
