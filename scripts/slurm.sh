#!/usr/bin/env bash
# A real Slurm (Debian's slurm-wlm 22.05: munge + slurmctld + slurmd) on this machine, for tests.
#   scripts/slurm.sh up     start (idempotent); installs slurm-wlm and munge with apt when missing
#   scripts/slurm.sh down   stop the daemons it started (by their pid files only)
#   scripts/slurm.sh env    print `export SLURM_CONF=...` for the clients (sbatch, squeue, scontrol)
# State, logs, sockets and fake GPU devices live under $SLURM_DIR (default: <repo>/.slurm, git-ignored).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${SLURM_DIR:-$REPO/.slurm}"
NGPU="${SLURM_FAKE_GPUS:-4}"
CTLD_PORT="${SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${SLURM_D_PORT:-16818}"
HOST="$(hostname -s)"
CONF="$DIR/etc/slurm.conf"

need_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  echo "installing slurm-wlm and munge (apt)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurm-wlm munge >/dev/null
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  mkdir -p "$DIR"/{etc,state,spool,log,run,munge,dev}
  chmod 700 "$DIR/munge"
  # fake GPUs: 22.05 drops file-less gpu gres and drains the node, so File= points at char devices
  for i in $(seq 0 $((NGPU - 1))); do
    [ -c "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3
  done
  local cpus mem
  # twice the cores: the tests run a job that only waits for its time limit (at nice 19) beside the
  # jobs that work; config_overrides keeps slurmd from draining a node that reports fewer
  cpus=$(( $(nproc) * 2 ))
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
  cat > "$CONF" <<CONF
ClusterName=trainledger
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default, one job takes all the node's memory and the next waits
DefMemPerCPU=1024
GresTypes=gpu
ReturnToService=2
# completions go to a text file (sacct would need slurmdbd + a database)
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
# time limits are enforced promptly: a short-limit test should not wait minutes
KillWait=5
OverTimeLimit=0
# a task runs at the nice value of the command that submitted it (sbatch, srun): a test whose job only
# has to outlive its time limit submits at nice 19, so its spinning ranks take what the others leave
PropagatePrioProcess=1
InactiveLimit=0
MinJobAge=600
SchedulerParameters=defer
SlurmdParameters=config_overrides
NodeName=$HOST CPUs=$cpus RealMemory=$mem Gres=gpu:$NGPU State=UNKNOWN
PartitionName=gpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  : > "$DIR/etc/gres.conf"
  for i in $(seq 0 $((NGPU - 1))); do
    echo "NodeName=$HOST Name=gpu File=$DIR/dev/gpu$i" >> "$DIR/etc/gres.conf"
  done
  echo "ConstrainDevices=no" > "$DIR/etc/cgroup.conf"
}

up() {
  need_packages
  write_conf
  export SLURM_CONF="$CONF"
  if ! alive "$DIR/run/munged.pid"; then
    [ -f /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; chmod 400 /etc/munge/munge.key; }
    munged --force --socket="$DIR/munge/munge.socket.2" --pid-file="$DIR/run/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --key-file=/etc/munge/munge.key
  fi
  alive "$DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
  alive "$DIR/run/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 1 100); do
    if sinfo -h -o "%t" 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
      echo "slurm up: SLURM_CONF=$CONF ($(sinfo -h -o '%P %D %t %G'))"
      return 0
    fi
    # a node left down/drained by an earlier run is brought back
    scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
    sleep 0.2
  done
  echo "slurm did not come up; logs in $DIR/log" >&2
  tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  return 1
}

down() {
  for d in slurmd slurmctld munged; do
    local pf="$DIR/run/$d.pid"
    if alive "$pf"; then
      kill "$(cat "$pf")"
      for _ in $(seq 1 50); do alive "$pf" || break; sleep 0.1; done
    fi
    rm -f "$pf"
  done
  echo "slurm down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
