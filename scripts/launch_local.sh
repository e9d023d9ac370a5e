#!/usr/bin/env bash
# Starts N processes on 127.0.0.1, each with K CPU devices, joined with jax.distributed (CPU collectives).
#   scripts/launch_local.sh -n 2 -d 4 -- python -m megajax.train --config configs/tiny.yaml
# Each line of output is prefixed with its process rank. SIGTERM or SIGINT (Ctrl-C) to the launcher is passed on
# to every process, and the launcher waits while they agree on a step, save one checkpoint and exit. If a process
# fails, the launcher prints which process the heartbeats say is behind (megajax.watchdog), the others get SIGTERM
# and, after MEGAJAX_LAUNCH_GRACE seconds (default 10), SIGKILL (a process left in a collective with a dead peer
# never returns from it); the launcher exits with the failed process's status.
# --restarts R: after a process is killed by a signal or hangs (the watchdog's exit 86), start the job again, up to R
# times, on the processes left: one killed with SIGKILL counts as lost and is not started again (as a lost host would
# not be); the others (a crash, a peer's abort, a hang) start again on as many processes. With
# --set train.elastic=true the run takes the planner's layout for the devices left and resumes from its newest
# checkpoint. A process that fails with an error is not restarted.
# --pin binds process i to CPU core i (taskset).
set -uo pipefail

usage() {
  echo "usage: $0 -n NUM_PROCESSES [-d CPU_DEVICES_PER_PROCESS] [-p PORT] [--restarts R] [--pin] -- COMMAND..." >&2
  exit 2
}
n=""; d=1; port=""; pin=0; restarts=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n="$2"; shift 2 ;;
    -d) d="$2"; shift 2 ;;
    -p) port="$2"; shift 2 ;;
    --restarts) restarts="$2"; shift 2 ;;
    --pin) pin=1; shift ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ -n "$n" ] && [ $# -gt 0 ] || usage
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
[ -n "$port" ] || port=$(free_port)
grace="${MEGAJAX_LAUNCH_GRACE:-10}"
hang_exit=86  # megajax.watchdog.HANG_EXIT
case "$(basename "$1")" in python*) py="$1" ;; *) py=python3 ;; esac
progress_root="${MEGAJAX_PROGRESS_DIR:-$(mktemp -d -t megajax-progress.XXXXXX)}"
[ -n "${MEGAJAX_PROGRESS_DIR:-}" ] || trap 'rm -rf "$progress_root"' EXIT

pass_on() {  # a stop request: every process saves at the step they agree on and exits
  stopping=1
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

run_job() {  # starts n processes, waits for all; sets status (the first failure's) and lost (processes lost)
  export MEGAJAX_PROGRESS_DIR="$progress_root/$attempt"
  mkdir -p "$MEGAJAX_PROGRESS_DIR"
  pids=(); printers=(); declare -gA rank_of=()
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
  status=0; lost=0; reporter=""
  declare -A running=()
  for pid in "${pids[@]}"; do running[$pid]=1; done
  while [ "${#running[@]}" -gt 0 ]; do
    done_pid=""
    wait -n -p done_pid "${!running[@]}"
    rc=$?
    if [ -z "${done_pid:-}" ]; then  # a signal interrupted the wait (it was passed on), or bash reaped it before
      for pid in "${!running[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then done_pid=$pid; wait "$pid"; rc=$?; break; fi
      done
      [ -n "${done_pid:-}" ] || continue
    fi
    unset "running[$done_pid]"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
      status=$rc
      [ "$rc" -eq 137 ] && [ "${stopping:-0}" = 0 ] && lost=1  # SIGKILL: as a lost host (or the OOM killer)
      echo "[launcher] process ${rank_of[$done_pid]} (pid $done_pid) exited with $rc: stopping the others" >&2
      # which process the heartbeats say is behind (read before the others are ended), then end them
      ( "$py" -m megajax.watchdog "$MEGAJAX_PROGRESS_DIR" 2>/dev/null | sed -u 's/^/[launcher] /' >&2
        end_the_rest ) &
      reporter=$!
    fi
  done
  [ -z "$reporter" ] || wait "$reporter" 2>/dev/null
  wait "${printers[@]}" 2>/dev/null
}

attempt=0
while true; do
  run_job "$@"
  if [ "$status" -eq 0 ] || [ "${stopping:-0}" = 1 ] || [ "$attempt" -ge "$restarts" ]; then
    exit "$status"
  fi
  if [ "$status" -le 128 ] && [ "$status" -ne "$hang_exit" ]; then
    exit "$status"  # an error of the run itself: starting again would fail the same way
  fi
  n=$((n - lost))
  if [ "$n" -lt 1 ]; then
    exit "$status"
  fi
  attempt=$((attempt + 1))
  port=$(free_port)
  why=$([ "$lost" = 1 ] && echo "a process was lost" || echo "a process hung")
  echo "[launcher] restart $attempt of $restarts: $why; starting $n process(es) of $d devices" >&2
done
