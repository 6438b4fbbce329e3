#!/usr/bin/env bash
# Stop the test cluster that start_cluster.sh started: cancel its jobs, then stop the
# daemons whose PIDs are in its pid files (each checked against /proc/PID/comm first;
# nothing is ever killed by name), and remove the /etc/hosts line it added.
#   bash scripts/slurm/stop_cluster.sh [--purge]    --purge also deletes $HPC_RLHF_SLURM_DIR
set -uo pipefail
DIR=${HPC_RLHF_SLURM_DIR:-/tmp/hpc-rlhf-slurm}
export PATH=$PATH:/usr/sbin:/sbin   # the daemons live in sbin
PURGE=0; [ "${1:-}" = --purge ] && PURGE=1
export SLURM_CONF=$DIR/etc/slurm.conf
log() { echo "[hpc-rlhf-slurm] $*" >&2; }
alive() { local pid; pid=$(tr -dc 0-9 2>/dev/null <"$1") || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] \
    && ! grep -qE '^State:\s+[ZX]' "/proc/$pid/status" 2>/dev/null && echo "$pid"; }
stop() {  # stop PIDFILE COMM: SIGTERM, up to 15 s, then SIGKILL
  local pid i; pid=$(alive "$1" "$2") || { rm -f "$1"; return 0; }
  kill -TERM "$pid"
  for i in $(seq 150); do alive "$1" "$2" >/dev/null || break; sleep 0.1; done
  if alive "$1" "$2" >/dev/null; then log "$2 ($pid) still up after SIGTERM: SIGKILL"; kill -KILL "$pid"; fi
  log "stopped $2 ($pid)"; rm -f "$1"
}

if [ -z "${HPC_RLHF_SLURM_LOCKED:-}" ] && [ -d "$(dirname "$DIR")" ]; then
  exec 9>"$DIR.lock"; flock -w 600 9 || log "could not lock $DIR.lock; going on"
fi
# jobs first, while slurmctld runs, so that their processes (slurmstepd, tasks) end too
if [ -f "$SLURM_CONF" ] && alive "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null | sort -u)
  if [ -n "$jobs" ]; then
    log "cancelling jobs: $(echo $jobs)"
    scancel $jobs 2>/dev/null
    for i in $(seq 200); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi
for pf in "$DIR"/run/slurmd-*.pid; do [ -e "$pf" ] && stop "$pf" slurmd; done
stop "$DIR/run/slurmctld.pid" slurmctld
stop "$DIR/run/slurmdbd.pid" slurmdbd
stop "$DIR/db/mariadb.pid" mariadbd
stop "$DIR/run/munged.pid" munged
# our /etc/hosts line ends with "# hpc-rlhf-slurm:$DIR" (rewritten in place: it may be a mount)
TAG="hpc-rlhf-slurm:$DIR"
if awk -v t="$TAG" '$NF == t && $(NF-1) == "#" {found=1} END {exit !found}' /etc/hosts 2>/dev/null; then
  hosts=$(awk -v t="$TAG" '!($NF == t && $(NF-1) == "#")' /etc/hosts); printf '%s\n' "$hosts" >/etc/hosts
fi
if [ "$PURGE" = 1 ]; then rm -rf "$DIR" "$DIR.apt.log" "$DIR.lock" && log "removed $DIR"; fi
log "stopped"
