#!/usr/bin/env bash
# Start a real Slurm cluster on this one machine, for hpc_rlhf's launch tests.
#
#   munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd x N  ("nodes" node1..nodeN)
#
# Every node is a slurmd process on 127.0.0.1 with its own port.  Several nodes are
# needed because a heterogeneous job gets one node per component (with one node a
# 2-component het job stays PENDING forever).  Accounting (mariadb + slurmdbd) is on so
# that `sacct` works: submitit relies on it to notice jobs that crashed.
#
# Needs root (daemons run as root, apt installs the Debian packages when missing) and no
# systemd.  Everything lives under $HPC_RLHF_SLURM_DIR; each daemon's PID is in a pid
# file there, and stop_cluster.sh stops exactly those.  Adds "127.0.0.1 node1 .. nodeN" to
# /etc/hosts (stop_cluster.sh takes it out).  Idempotent: when our cluster is already up and
# healthy this only checks it.  Afterwards:  source $DIR/env.sh   (exports SLURM_CONF)
#
# Env (all optional):
#   HPC_RLHF_SLURM_DIR=/tmp/hpc-rlhf-slurm   config, state, logs, pid files, accounting DB
#   HPC_RLHF_SLURM_NODES=3                   number of slurmd nodes
#   HPC_RLHF_SLURM_CPUS=4                    CPUs declared per node (may exceed the real count)
#   HPC_RLHF_SLURM_PORT_BASE=6900            slurmctld BASE+17, slurmdbd BASE+19, nodeK BASE+30+K
#   HPC_RLHF_SLURM_DB_PORT=3407              mariadb (127.0.0.1)
#   HPC_RLHF_SLURM_INSTALL=1                 0: never run apt-get
# The ports differ from Slurm's defaults (6817/6819/...), so a second local test cluster
# can run beside this one.
set -euo pipefail

DIR=${HPC_RLHF_SLURM_DIR:-/tmp/hpc-rlhf-slurm}
export PATH=$PATH:/usr/sbin:/sbin   # the daemons live in sbin
NODES=${HPC_RLHF_SLURM_NODES:-3}
CPUS=${HPC_RLHF_SLURM_CPUS:-4}
BASE=${HPC_RLHF_SLURM_PORT_BASE:-6900}
DB_PORT=${HPC_RLHF_SLURM_DB_PORT:-3407}
INSTALL=${HPC_RLHF_SLURM_INSTALL:-1}
CTLD_PORT=$((BASE + 17)) DBD_PORT=$((BASE + 19)) SLURMD_PORT0=$((BASE + 30))
CLUSTER=hpcrlhf
HOSTS_TAG="hpc-rlhf-slurm:$DIR"   # our /etc/hosts line ends with "# $HOSTS_TAG"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SLURM_CONF=$DIR/etc/slurm.conf
MUNGE_SOCK=$DIR/munge/munge.sock
DB_SOCK=$DIR/db/mariadb.sock
T0=$SECONDS

log() { echo "[hpc-rlhf-slurm] $*" >&2; }
tails() { local f; for f in "$DIR"/log/*.log "$DIR"/db/*.err; do
  [ -s "$f" ] && { echo "--- $f (last 20 lines)"; tail -n 20 "$f"; }; done >&2; }
die() { log "ERROR: $*"; tails
  if [ "${STARTING:-0}" = 1 ]; then log "stopping the daemons started so far"; bash "$HERE/stop_cluster.sh" >&2 || true; fi
  exit 1; }
# alive PIDFILE COMM: print the PID if that process runs and really is COMM
alive() { local pid; pid=$(tr -dc 0-9 2>/dev/null <"$1") || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] \
    && ! grep -qE '^State:\s+[ZX]' "/proc/$pid/status" 2>/dev/null && echo "$pid"; }
# wait_until SECONDS WHAT CMD...
wait_until() { local end=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do [ $SECONDS -lt $end ] || die "timed out waiting for $what"; sleep 0.2; done; }
daemons_alive() {
  alive "$DIR/run/munged.pid" munged && alive "$DIR/db/mariadb.pid" mariadbd \
    && alive "$DIR/run/slurmdbd.pid" slurmdbd && alive "$DIR/run/slurmctld.pid" slurmctld || return 1
  local k; for k in $(seq 1 "$NODES"); do alive "$DIR/run/slurmd-node$k.pid" slurmd || return 1; done; }
nodes_up() {  # NODES nodes in partition debug, none down/drained/not responding ('*')
  local st; st=$(sinfo -h -N -p debug -o %T) || return 1
  [ "$(grep -c . <<<"$st")" -ge "$NODES" ] && ! grep -qvE '^(idle|mixed|allocated|completing)$' <<<"$st"; }
healthy() { daemons_alive && scontrol ping | grep -q UP && nodes_up; }

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }
[ "$NODES" -ge 1 ] || { log "HPC_RLHF_SLURM_NODES must be >= 1"; exit 1; }
mkdir -p "$(dirname "$DIR")"
if [ -z "${HPC_RLHF_SLURM_LOCKED:-}" ]; then   # one start/stop at a time (set: the caller holds the lock)
  exec 9>"$DIR.lock"; flock -w 600 9 || die "could not lock $DIR.lock"
  export HPC_RLHF_SLURM_LOCKED=1               # stop_cluster.sh, run from here, must not wait for it
fi

# ---- packages
missing=()
for c in munged slurmctld slurmd slurmdbd srun sbatch sacct mariadbd mariadb-install-db; do
  command -v "$c" >/dev/null || missing+=("$c"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || die "missing ${missing[*]} and HPC_RLHF_SLURM_INSTALL=0"
  log "installing Slurm, munge, mariadb (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || log "apt-get update failed; trying the install anyway"
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server \
    >"$DIR.apt.log" 2>&1 || { tail -n 30 "$DIR.apt.log" >&2; die "apt-get install failed (log: $DIR.apt.log)"; }
fi
T_INSTALL=$((SECONDS - T0))

# ---- already running?
if daemons_alive >/dev/null; then
  end=$((SECONDS + 30)); until healthy >/dev/null 2>&1 || [ $SECONDS -ge $end ]; do sleep 0.5; done
  if healthy >/dev/null 2>&1; then
    echo "hpc-rlhf-slurm: already running ($NODES nodes, checked in $((SECONDS - T0))s); SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  log "running but unhealthy; restarting it"
fi
if compgen -G "$DIR/run/*.pid" >/dev/null || [ -e "$DIR/db/mariadb.pid" ]; then
  bash "$HERE/stop_cluster.sh" >&2 || true   # leftovers of an earlier start
fi

# ---- config (a fresh state each start: job ids begin at 1 again; no pytest session uses it yet)
rm -rf "$DIR"/{etc,state,log,run,db,munge,sessions}
mkdir -p "$DIR"/{etc,state,log,run,db,munge}
chmod 0755 "$DIR"
HOST=$(hostname)
# NoInAddrAny/NoCtldInAddrAny: daemons (and srun) bind to the address of `hostname`, not to 0.0.0.0
case "$(getent ahostsv4 "$HOST" | awk 'NR==1{print $1}')" in
  127.*) ;; *) log "WARNING: $HOST does not resolve to 127.x; Slurm will listen on its address" ;; esac
MEM=$(awk '/^MemTotal/{print int($2/1024)}' /proc/meminfo)
if [ "$NODES" = 1 ]; then NODESPEC=node1 PORTS=$((SLURMD_PORT0 + 1))
else NODESPEC="node[1-$NODES]" PORTS="[$((SLURMD_PORT0 + 1))-$((SLURMD_PORT0 + NODES))]"; fi
cat >"$SLURM_CONF" <<EOF
# Written by hpc_rlhf scripts/slurm/start_cluster.sh: a single-machine test cluster.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may run again (default 120 s)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
MpiDefault=none
# no cgroups here: track job processes through /proc, no CPU binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
# backfill starts het jobs (every 1 s); the main loop starts requeued jobs (every 2 s, not 60)
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# nodes declare $CPUS CPUs whatever the machine has; without this slurmd would drain them
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
# finished jobs stay visible to scontrol for 10 minutes
MinJobAge=600
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/slurmd-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# a job in 'urgent' preempts (SIGTERM, 5 s grace, requeue) jobs in 'debug'
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=$NODESPEC NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$PORTS CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=5
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
# slurmdbd reads slurmdbd.conf next to slurm.conf; it must be 0600 and owned by SlurmUser
cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
CommunicationParameters=NoInAddrAny
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=hpc-rlhf
StorageLoc=slurm_acct_db
EOF
chmod 0600 "$DIR/etc/slurmdbd.conf"
echo "export SLURM_CONF=$SLURM_CONF" >"$DIR/env.sh"

# node names resolve (to 127.0.0.1), e.g. for a MASTER_ADDR taken from SLURM_JOB_NODELIST
names=$(for k in $(seq 1 "$NODES"); do printf ' node%s' "$k"; done)
if ! grep -qxF "127.0.0.1$names # $HOSTS_TAG" /etc/hosts; then   # (rewritten in place: may be a mount)
  hosts=$(awk -v t="$HOSTS_TAG" '!($NF == t && $(NF-1) == "#")' /etc/hosts)  # minus an older line of ours
  printf '%s\n127.0.0.1%s # %s\n' "$hosts" "$names" "$HOSTS_TAG" >/etc/hosts || log "cannot edit /etc/hosts"
fi

# ---- daemons (each with fd 9 closed: a daemon must not inherit, and so hold, our lock)
STARTING=1
mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null \
  || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$DIR/munge/munge.key"
munged --socket="$MUNGE_SOCK" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
  --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed" --force 9>&- || die "munged did not start"
wait_until 10 munged bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'"

chown mysql:mysql "$DIR/db"
mariadb-install-db --user=mysql --datadir="$DIR/db/data" --auth-root-authentication-method=socket \
  --skip-test-db >"$DIR/db/install.out" 2>&1 || die "mariadb-install-db failed (see $DIR/db/install.out)"
setsid -f mariadbd --no-defaults --user=mysql --datadir="$DIR/db/data" --socket="$DB_SOCK" \
  --pid-file="$DIR/db/mariadb.pid" --log-error="$DIR/db/mariadb.err" --bind-address=127.0.0.1 \
  --port="$DB_PORT" --skip-name-resolve --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 9>&-
wait_until 60 mariadbd mariadb --no-defaults -S "$DB_SOCK" -uroot -e 'select 1'
mariadb --no-defaults -S "$DB_SOCK" -uroot -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'hpc-rlhf';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "mariadb: cannot create the slurm user"
slurmdbd 9>&- || die "slurmdbd did not start"
wait_until 60 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"

slurmctld 9>&- || die "slurmctld did not start"
wait_until 30 slurmctld bash -c "scontrol ping | grep -q UP"
for k in $(seq 1 "$NODES"); do slurmd -N "node$k" 9>&- || die "slurmd node$k did not start"; done
wait_until 60 "$NODES idle nodes" nodes_up
# slurmctld registers the cluster in the accounting DB by itself; sacct needs that
wait_until 30 "cluster registration in slurmdbd" bash -c "sacctmgr -n -P list cluster format=cluster | grep -qx $CLUSTER"
healthy >/dev/null || die "cluster not healthy after start"
echo "hpc-rlhf-slurm: started in $((SECONDS - T0))s (install ${T_INSTALL}s): $NODES nodes x $CPUS CPUs," \
  "slurmctld 127.0.0.1:$CTLD_PORT; SLURM_CONF=$SLURM_CONF"
