#!/usr/bin/env bash
# start_cluster.sh DIR             start the cluster
# start_cluster.sh DIR --node nX   start slurmd nX again in a running cluster (after it was killed)
#
# Start a throw-away, single-host Slurm cluster (real slurmctld + slurmd +
# munged from Debian's packages) whose config, state, spool, logs, pid files
# and munge key/socket all live under DIR.  No systemd, nothing in /etc.
#
# Default: 2 Slurm nodes (n1, n2) on this host, each its own `slurmd -N nX`
# with its own Port= (Slurm's "multiple slurmd" mode, which Debian's build has:
# `scontrol show config` says MULTIPLE_SLURMD = Yes).  Node i gets
# NodeAddr=127.0.0.(10+i) (all of 127/8 is loopback; not 127.0.0.1, which Ray rewrites to the
# host's network address wherever it is given as a cluster address), so each "node" has an address
# of its own that jobs can look up with `scontrol show node $SLURMD_NODENAME`.
# slurmctld listens on 127.0.0.1 only; slurmd on all addresses (its port only).
#
# stdout: only `export NAME=value` lines (eval them), e.g.
#     eval "$(start_cluster.sh /tmp/slurm-test)"
# stderr: progress and, on failure, the tails of the daemon logs.
# Exit status: 0 when `sinfo` shows all nodes idle, non-zero otherwise
# (on failure everything already started is stopped again).
#
# Tunables (environment):
#   SLURM_LOCAL_NODES          number of Slurm nodes          (default 2)
#   SLURM_LOCAL_CPUS_PER_NODE  CPUs= for each node            (default 1)
#   SLURM_LOCAL_MEM_PER_NODE   RealMemory= (MB) for each node (default 1000)
#   SLURM_LOCAL_TIMEOUT        seconds to wait for idle nodes (default 60)
#
# Requires: root, packages slurmctld slurmd slurm-client munge.
# Stop with: stop_cluster.sh DIR
# Used by tests/e2e/test_slurm_e2e.py (the fixture in tests/e2e/conftest.py); handy to try
# launch/slurm/megarl.sbatch on one machine:
#   eval "$(launch/slurm/local/start_cluster.sh /tmp/slurm-try)"
#   SLURM_LOCAL_CPUS_PER_NODE=1 ... sbatch --nodes=2 launch/slurm/megarl.sbatch recipe.yaml
set -euo pipefail

log() { printf '[slurm-local] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# alive PID: exists and is not a zombie (some PID 1s reap late)
alive() {
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

[ $# -eq 1 ] || [ $# -eq 3 -a "${2:-}" = --node ] || die "usage: $0 DIR [--node nX]"
NNODES=${SLURM_LOCAL_NODES:-2}
CPUS=${SLURM_LOCAL_CPUS_PER_NODE:-1}
MEM=${SLURM_LOCAL_MEM_PER_NODE:-1000}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ---------------------------------------------------------------- prerequisites
[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd/slurmstepd need it)"
for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/sinfo \
         /usr/bin/scontrol /usr/bin/srun /usr/bin/sbatch; do
  [ -x "$b" ] || die "$b missing: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
done

mkdir -p "$1"
DIR=$(cd "$1" && pwd -P)
if [ $# -eq 3 ]; then   # --node nX: one slurmd again, with the cluster's own settings
  NODE=$3
  [ -e "$DIR/run/started" ] || die "$DIR holds no started cluster"
  BASE=$(cat "$DIR/run/base")
  grep -q "^NodeName=$NODE " "$DIR/etc/slurm.conf" || die "no node $NODE in $DIR/etc/slurm.conf"
  alive "$(cat "$DIR/run/slurmd-$NODE.pid" 2>/dev/null || echo 0)" && die "slurmd $NODE is running"
  env "_SLURM_LOCAL_DAEMON_OF=$DIR" SLURM_CONF="$BASE/etc/slurm.conf" \
    setsid /usr/sbin/slurmd -D -N "$NODE" -f "$BASE/etc/slurm.conf" </dev/null >>"$DIR/log/slurmd-$NODE.out" 2>&1 &
  echo $! > "$DIR/run/slurmd-$NODE.pid"
  export SLURM_CONF=$BASE/etc/slurm.conf
  deadline=$(( $(date +%s) + TIMEOUT ))
  # registered when its port listens (it binds after talking to slurmctld) and the node is idle
  port=$(sed -n "s/^NodeName=$NODE .*Port=\([0-9]*\).*/\1/p" "$DIR/etc/slurm.conf")
  listening() {
    awk -v h="$(printf '%04X' "$1")" 'FNR > 1 { split($2, a, ":"); if (a[2] == h && $4 == "0A") f = 1 } END { exit !f }' \
      /proc/net/tcp /proc/net/tcp6 2>/dev/null
  }
  until listening "$port" && sinfo -h -n "$NODE" -o '%t' 2>/dev/null | grep -qx idle; do
    alive "$(cat "$DIR/run/slurmd-$NODE.pid")" || die "slurmd $NODE exited"
    [ "$(date +%s)" -lt "$deadline" ] || die "node $NODE not idle after ${TIMEOUT}s"
    sleep 0.2
  done
  log "node $NODE idle again"
  exit 0
fi
[ -e "$DIR/run/started" ] && die "$DIR already holds a started cluster; stop it first"

# Unix socket paths (munge socket, slurmstepd sockets in the spool dir such as
# BASE/spool/n1/n1_4294967292.4294967294) must fit in 108 bytes.  If DIR is
# long, address everything through a short symlink in /tmp that points at DIR.
BASE=$DIR
if [ ${#DIR} -gt 48 ]; then
  BASE=$(mktemp -u /tmp/slurmlocal.XXXXXX)
  ln -s "$DIR" "$BASE"
  log "DIR is long; using short alias $BASE -> $DIR"
fi

mkdir -p "$DIR"/{etc,state,log,run,munge,spool}
# Jobs submitted as a non-root user (sbatch --uid=...) need to traverse DIR to
# reach their job script in the spool dir.  (Parents of DIR must be o+x too.)
chmod 755 "$DIR" "$DIR/spool"
chmod 755 "$DIR/munge"   # socket must be reachable by job users; key stays 0600
echo "$BASE" > "$DIR/run/base"

# ---------------------------------------------------------------- free ports
# Below the Linux ephemeral range (32768+) so outgoing connections can't take them.
# (reads /proc/net/tcp* directly: no dependency on iproute2's `ss`)
port_busy() {
  awk -v h="$(printf '%04X' "$1")" \
    'FNR > 1 { split($2, a, ":"); if (a[2] == h && $4 == "0A") f = 1 } END { exit !f }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
PORTS=()
need=$((NNODES + 1))
p=$(( 20000 + (RANDOM % 1200) * 10 ))
tries=0
while [ ${#PORTS[@]} -lt $need ]; do
  [ $p -lt 32700 ] || p=20000
  port_busy $p || PORTS+=("$p")
  p=$((p + 1)); tries=$((tries + 1))
  [ $tries -lt 12700 ] || die "no free TCP ports in 20000-32699"
done
CTLD_PORT=${PORTS[0]}

# ---------------------------------------------------------------- munge
MUNGE_SOCK=$BASE/munge/munge.socket
if command -v mungekey >/dev/null 2>&1; then
  mungekey --create --keyfile="$DIR/munge/munge.key" --force
else
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 600 "$DIR/munge/munge.key"

# Everything we start carries this marker in its environment; stop_cluster.sh
# uses it to find (only) our processes.
MARK="_SLURM_LOCAL_DAEMON_OF=$DIR"

# launch NAME CMD... : run CMD in its own session, in the background, all fds
# detached (so a caller capturing our stdout does not hang), pid -> run/NAME.pid
launch() {
  local name=$1; shift
  env "$MARK" SLURM_CONF="$BASE/etc/slurm.conf" \
    setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo $! > "$DIR/run/$name.pid"
}

cleanup_on_error() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    log "start failed (rc=$rc); log tails:"
    # *.out = each daemon's stderr (with -D/--foreground it carries the whole log)
    for f in "$DIR"/log/*.out; do [ -f "$f" ] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }; done
    "$HERE/stop_cluster.sh" "$DIR" >&2 || true
  fi
}
trap cleanup_on_error EXIT

t0=$(date +%s.%N)
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
launch munged /usr/sbin/munged --foreground --force \
  --socket="$MUNGE_SOCK" --key-file="$DIR/munge/munge.key" \
  --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
  --num-threads=2   # --foreground: munged logs to stderr -> log/munged.out
for _ in $(seq 100); do [ -S "$MUNGE_SOCK" ] && break; sleep 0.1; done
[ -S "$MUNGE_SOCK" ] || die "munged did not create $MUNGE_SOCK"

# ---------------------------------------------------------------- slurm.conf
CTLD_HOST=$(hostname -s)
NODELIST=""
{
cat <<EOF
# generated by start_cluster.sh -- single-host test cluster
ClusterName=localtest
SlurmctldHost=${CTLD_HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${MUNGE_SOCK}
StateSaveLocation=${BASE}/state
SlurmdSpoolDir=${BASE}/spool/%n
SlurmctldPidFile=${BASE}/run/slurmctld.daemon.pid
SlurmdPidFile=${BASE}/run/slurmd-%n.daemon.pid
SlurmctldLogFile=${BASE}/log/slurmctld.log
SlurmdLogFile=${BASE}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=${BASE}/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
# Slurm's default: a job notices a lost node itself first (megarl names it) instead of being
# killed by slurmctld after a short timeout
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=30
KillWait=5
Waittime=0
CommunicationParameters=NoCtldInAddrAny
EOF
for i in $(seq 1 "$NNODES"); do
  echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.$((10 + i)) Port=${PORTS[$i]} CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN"
  NODELIST+="${NODELIST:+,}n$i"
done
echo "PartitionName=debug Nodes=${NODELIST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
} > "$DIR/etc/slurm.conf"
: > "$DIR/etc/plugstack.conf"
export SLURM_CONF=$BASE/etc/slurm.conf

# ---------------------------------------------------------------- daemons
launch slurmctld /usr/sbin/slurmctld -D -i -f "$SLURM_CONF"
for _ in $(seq 150); do
  scontrol ping 2>/dev/null | grep -q 'is UP' && break
  alive "$(cat "$DIR/run/slurmctld.pid")" || die "slurmctld exited"
  sleep 0.2
done
scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld not answering"
log "slurmctld up after $(elapsed)s"

for i in $(seq 1 "$NNODES"); do
  mkdir -p "$DIR/spool/n$i"
  launch "slurmd-n$i" /usr/sbin/slurmd -D -N "n$i" -f "$SLURM_CONF"
done

deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"' | wc -l)
  [ "$idle" -ge "$NNODES" ] && break
  for i in $(seq 1 "$NNODES"); do
    alive "$(cat "$DIR/run/slurmd-n$i.pid")" || die "slurmd n$i exited"
  done
  [ "$(date +%s)" -lt "$deadline" ] || { sinfo -N -l >&2 || true; die "nodes not idle after ${TIMEOUT}s"; }
  sleep 0.2
done
touch "$DIR/run/started"
trap - EXIT
log "cluster up (all nodes idle) after $(elapsed)s: $NNODES node(s), slurmctld port $CTLD_PORT, slurmd ports ${PORTS[*]:1}"

echo "export SLURM_CONF=$SLURM_CONF"
echo "export SLURM_LOCAL_DIR=$DIR"
