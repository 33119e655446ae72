#!/usr/bin/env bash
# A Slurm cluster on this machine, for tests/test_slurm.py and tests/test_slurm_vllm.py.
#
# CI runs the sbatch recipes in slurm/ against a real slurmctld + slurmd instead of a mock, so
# that requeue, signals and the batch environment are Slurm's own. This script is idempotent:
# it installs what is missing, (re)writes the config, starts only the daemons that are not
# running, and returns once `sinfo` reports the node idle. Needs root; does not need systemd
# (containers usually have none) nor cgroups (proctrack/linuxproc, task/none).
#
#   sudo .ci/slurm-setup.sh            # then: .venv/bin/python -m pytest -q tests/test_slurm.py
#
# Nodes: this machine under its own name (partition `debug`, the default), and EMULATED_NODES
# (default 3) more, gspo-n1..gspo-nN in partition `nodes`, each a slurmd of its own (`slurmd -N`)
# with an address of its own on the loopback (127.0.1.i, written to /etc/hosts): a job there
# has several nodes whose names resolve, whose servers may share a port, and whose steps are
# placed by --nodelist, as on a cluster; they share this machine's CPUs.
#
# Environment: SLURM_SETUP_STATE (default /var/spool/megatron-gspo-slurm) holds state, spool
# and daemon logs; SLURM_SETUP_TIMEOUT (default 60) bounds the wait for the node.
set -euo pipefail

STATE=${SLURM_SETUP_STATE:-/var/spool/megatron-gspo-slurm}
TIMEOUT=${SLURM_SETUP_TIMEOUT:-60}
EMULATED_NODES=${EMULATED_NODES:-3}
CONF_DIR=/etc/slurm

if [ "$(id -u)" -ne 0 ]; then
  echo "slurm-setup: needs root (it installs packages and starts daemons)" >&2
  exit 1
fi

# 1. Packages. --no-install-recommends skips ~20 plugin packages the tests do not use.
need=()
for cmd in slurmctld slurmd sbatch munged shellcheck; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "slurm-setup: installing (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge shellcheck >/dev/null
fi

# 2. Munge: the package creates a key on install; make one if an image stripped it.
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  # munged refuses root; run it as its own user, which needs no --force.
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 20); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.5
  done
fi

# 3. Config. The node is this machine under its own name (srun, MASTER_ADDR and
# `scontrol show hostnames` then give a name that resolves); sizes come from the machine.
node=$(hostname -s)
cpus=$(nproc)
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
install -d -m 0755 "$STATE" "$STATE/ctld" "$STATE/d" "$STATE/d/$node" "$CONF_DIR"
nodes=("$node")
emulated=""
for i in $(seq "$EMULATED_NODES"); do
  name=gspo-n$i
  addr=127.0.1.$i
  nodes+=("$name")
  install -d -m 0755 "$STATE/d/$name"
  emulated+="NodeName=$name NodeHostname=$node NodeAddr=$addr Port=$((6820 + i)) CPUs=$cpus"
  emulated+=" RealMemory=$mem_mb State=UNKNOWN"$'\n'
  grep -qE "^${addr}[[:space:]]+${name}\$" /etc/hosts || printf '%s %s\n' "$addr" "$name" >>/etc/hosts
done
if [ "$EMULATED_NODES" -gt 0 ]; then
  emulated+="PartitionName=nodes Nodes=gspo-n[1-$EMULATED_NODES] Default=NO MaxTime=INFINITE"
  emulated+=" State=UP"
fi
conf=$(
  cat <<EOF
# Written by megatron-gspo .ci/slurm-setup.sh; rewritten on every run.
ClusterName=gspo-ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
# No cgroups in a container: track processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The tests requeue a running job and expect it to come back.
JobRequeue=1
# Time between SIGTERM and SIGKILL when a job is cancelled or requeued: long enough for the
# trainer to finish its step and write a checkpoint.
KillWait=60
# Keep finished jobs visible to scontrol (there is no accounting database for sacct).
MinJobAge=3600
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
$emulated
EOF
)
changed=0
if [ ! -f "$CONF_DIR/slurm.conf" ] || [ "$conf" != "$(cat "$CONF_DIR/slurm.conf")" ]; then
  printf '%s\n' "$conf" >"$CONF_DIR/slurm.conf"
  changed=1
fi

# 4. Daemons, started directly (no systemd). A changed config restarts running ones.
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$changed" -eq 1 ]; then
  for pidfile in "$STATE"/slurmd*.pid "$STATE/slurmctld.pid"; do
    if running "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 20); do running "$pidfile" || break; sleep 0.5; done
    fi
  done
fi
running "$STATE/slurmctld.pid" || slurmctld
for _ in $(seq 40); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
for n in "${nodes[@]}"; do
  running "$STATE/slurmd-$n.pid" || slurmd -N "$n"
done

# 5. Wait until the node takes jobs; a node left DOWN/DRAIN by an earlier run is resumed.
deadline=$((SECONDS + TIMEOUT))
for n in "${nodes[@]}"; do
  while :; do
    state=$(sinfo -h -n "$n" -o %T 2>/dev/null || true)
    case "$state" in
      idle* | mixed* | allocated*) break ;;
      down* | drain*) scontrol update NodeName="$n" State=RESUME 2>/dev/null || true ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "slurm-setup: node $n not idle after ${TIMEOUT}s (state: ${state:-none})" >&2
      tail -n 20 "$STATE/slurmctld.log" "$STATE/slurmd-$n.log" >&2 || true
      exit 1
    fi
    sleep 1
  done
done
echo "slurm-setup: nodes ${nodes[*]} up ($cpus CPUs, ${mem_mb} MB each, shared); logs in $STATE"
