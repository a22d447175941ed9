#!/usr/bin/env bash
# Start a single-host Slurm 22.05 cluster for the Slurm test tier (as root, no systemd, no munge):
# slurmctld + two slurmd (`-N c1`, `-N c2`) as two nodes, 2 fake GPUs each (char devices aliasing
# /dev/null, so jobs see CUDA_VISIBLE_DEVICES), partitions `gpu` (c1) and `cpu` (c2) like the
# defaults of slurm/run.sh, plus `debug` (both). Installs Debian's slurmctld/slurmd/slurm-client
# when missing (~25 s). Prints `export SLURM_CONF=...` on success.
#   MEGATRON_RL_SLURM_LAB  state dir (default /tmp/megatron-rl-slurm); one cluster per state dir
# Its ports (slurmctld, each slurmd) are free ones picked at start, so that two clusters (two test runs, or a
# developer's own) run side by side.
set -euo pipefail
LAB=${MEGATRON_RL_SLURM_LAB:-/tmp/megatron-rl-slurm}
NODES="c1 c2"
GPUS=2
[[ $(id -u) == 0 ]] || { echo "the Slurm test cluster needs root (it runs slurmctld/slurmd)" >&2; exit 3; }
export DEBIAN_FRONTEND=noninteractive
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  command -v apt-get >/dev/null || { echo "slurm is not installed and there is no apt-get" >&2; exit 3; }
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null; }
fi
bash "$(dirname "${BASH_SOURCE[0]}")/teardown.sh"  # a cluster left running by an earlier session
H=$(hostname)
read -r CPUS RMEM < <(slurmd -C | awk '/^NodeName/{for(i=1;i<=NF;i++){split($i,a,"=");v[a[1]]=a[2]}; print v["CPUs"], v["RealMemory"]}')
MEM=$(( (RMEM - 512) / 2 ))
# Node names must resolve like on a real cluster (ranks rendezvous at the first node's name,
# sandbox servers advertise theirs); tagged so teardown.sh removes exactly these lines.
for n in $NODES; do
  grep -qE "^127\.0\.0\.1 $n( |$)" /etc/hosts || echo "127.0.0.1 $n # megatron-rl-slurm-test" >> /etc/hosts
done
mkdir -p "$LAB"/{etc,ctld,spool,log,run,dev}
rm -rf "$LAB"/ctld/* "$LAB"/spool/* "$LAB"/log/*
echo "AutoDetect=off" > "$LAB/etc/gres.conf"
k=0
for n in $NODES; do
  first=$k
  for ((g = 0; g < GPUS; g++, k++)); do [[ -c "$LAB/dev/nvidia$k" ]] || mknod "$LAB/dev/nvidia$k" c 1 3; done
  echo "NodeName=$n Name=gpu File=$LAB/dev/nvidia[$first-$((k - 1))]" >> "$LAB/etc/gres.conf"
done
CONF=$LAB/etc/slurm.conf
read -r CTLD_PORT C1_PORT C2_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
cat > "$CONF" <<CONF
ClusterName=megatronrl
SlurmctldHost=$H
SlurmUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$LAB/ctld
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LAB/log/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=5
MinJobAge=300
JobRequeue=1
GresTypes=gpu
NodeName=c1 NodeHostname=$H NodeAddr=127.0.0.1 Port=$C1_PORT CPUs=$CPUS RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN
NodeName=c2 NodeHostname=$H NodeAddr=127.0.0.1 Port=$C2_PORT CPUs=$CPUS RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN
PartitionName=gpu Nodes=c1 MaxTime=INFINITE State=UP DefMemPerCPU=1024
PartitionName=cpu Nodes=c2 MaxTime=INFINITE State=UP DefMemPerCPU=1024
PartitionName=debug Nodes=c[1-2] Default=YES MaxTime=INFINITE State=UP DefMemPerCPU=1024
CONF
export SLURM_CONF=$CONF
slurmctld -c -f "$CONF"
for n in $NODES; do slurmd -f "$CONF" -N "$n"; done
st=""
for _ in $(seq 1 150); do  # up to 30 s for both nodes to register
  st=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  [[ "$st" == "idle " ]] && break
  sleep 0.2
done
[[ "$st" == "idle " ]] || { echo "slurm node state: '$st'" >&2; tail -n 20 "$LAB"/log/*.log >&2; exit 1; }
echo "export SLURM_CONF=$CONF"
