#!/bin/bash
# A real one-node SLURM on this machine (slurmctld and slurmd on localhost, munge for authentication), to run
# scripts/slurm.sbatch as a cluster would, with CPU tasks:
#
#   sudo scripts/slurm_local.sh            # installs Debian's slurm-wlm and munge if missing, then starts them
#   sbatch --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 scripts/slurm.sbatch configs/tiny.yaml \
#       parallel.data=2 train.output_dir=/tmp/slurm-run
#   scripts/slurm_local.sh stop            # stops the daemons
#
# Needs root (it writes /etc/slurm/slurm.conf and starts the daemons). It does nothing if a controller already
# answers. tests/test_slurm.py uses it (-m slow).
set -euo pipefail

if [[ "${1:-}" == stop ]]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  exit 0
fi

if [[ $(id -u) != 0 ]]; then
  echo "slurm_local.sh: needs root (it writes /etc/slurm/slurm.conf and starts munged, slurmctld, slurmd)" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

if scontrol ping 2>/dev/null | grep -q UP; then
  exit 0
fi

host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
[[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "/usr/sbin/munged --force"

# Process tracking by process group and no task plugin: no cgroups needed, so it runs in a container too.
# KillWait: seconds between the SIGTERM of a cancelled or timed-out job and its SIGKILL (time to save).
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=megajax-local
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=60
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

slurmctld
slurmd
for _ in $(seq 30); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    exit 0
  fi
  sleep 1
done
echo "slurm_local.sh: the node did not come up; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
