#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for CI: Debian's slurmctld + slurmd + munge,
# started by hand (no systemd), stopped by pid.
#
#   scripts/slurm_single_node.sh start    install the packages if missing, write the config,
#                                         start munged, slurmctld and slurmd, wait for "idle"
#   scripts/slurm_single_node.sh stop     stop the three daemons by the pids start recorded
#   scripts/slurm_single_node.sh env      print the SLURM_CONF line clients need
#
# Everything lives in $SLURM_CI_DIR (default /tmp/slurm-ci): slurm.conf, state, spool, logs
# and pid files. /etc/slurm is not touched: clients and daemons read $SLURM_CI_DIR/slurm.conf
# through SLURM_CONF (start prints it; `eval "$(scripts/slurm_single_node.sh env)"`). The
# daemons listen on free ports and munged on its own socket, so a second instance (another
# test session, or a Slurm already on the machine) does not collide with this one.
# Needs root (apt-get, daemons running as root). AUTH=none skips munge (auth/none).
# Facts behind every choice: ../shared/notes/slurm-single-node.md (Debian 12, Slurm 22.05).
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/slurm-ci}
AUTH=${AUTH:-munge}
CONF=$DIR/slurm.conf
# A name unique to this instance (its $DIR), short enough for a socket path.
MUNGE_DIR=/run/munge/ci-$(echo -n "$DIR" | md5sum | cut -c1-12)
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "[slurm-ci] $*"; }
die() { echo "[slurm-ci] ERROR: $*" >&2; exit 1; }

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && { log "packages present: ${PACKAGES[*]}"; return; }
    [ "$(id -u)" -eq 0 ] || die "installing ${missing[*]} needs root"
    log "installing ${missing[*]}"
    # Without systemd the packages' postinst would try to start the daemons through their
    # init scripts; forbid that for the install (we start them ourselves, with our config).
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local rc=0
    apt-get install -y --no-install-recommends "${missing[@]}" >"$DIR/apt.log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        log "apt-get install failed ($rc); refreshing the package lists and retrying"
        apt-get update >>"$DIR/apt.log" 2>&1 || true
        rc=0
        apt-get install -y --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1 || rc=$?
    fi
    [ $made_policy -eq 1 ] && rm -f "$policy"
    [ $rc -eq 0 ] || { tail -20 "$DIR/apt.log" >&2; die "apt-get install ${missing[*]} failed (log: $DIR/apt.log)"; }
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {   # a port nothing listens on, from a range clear of the usual ephemeral ports
    local p
    for _ in $(seq 1 200); do
        p=$(( 20000 + RANDOM % 12000 ))
        port_free "$p" && { echo "$p"; return; }
    done
    die "no free port found"
}

write_config() {
    local host mem cpus ctld_port slurmd_port
    host=$(hostname -s)
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    [ "$slurmd_port" = "$ctld_port" ] && slurmd_port=$(( ctld_port + 1 ))
    cpus=$(nproc --all)  # plain nproc honours OMP_NUM_THREADS, which the Makefile sets to 1
    mem=$(( $(free -m | awk '/^Mem:/{print $2}') - 1024 ))
    cat >"$CONF" <<EOF
# Written by scripts/slurm_single_node.sh: one node, root daemons, no accounting, no cgroups.
ClusterName=ci
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
AuthType=auth/${AUTH}
CredType=cred/${AUTH}
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=$( [ "$AUTH" = munge ] && echo "socket=${MUNGE_SOCKET}," )cred_expire=${SLURM_CI_CRED_EXPIRE:-20}
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then   # Debian's postinst normally creates it
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    # This instance's munged: its own socket, pid, log and seed files, in a directory the
    # munge user owns (under /run/munge, which it can reach whatever $DIR's permissions are).
    mkdir -p /run/munge; chown munge:munge /run/munge; chmod 0755 /run/munge
    runuser -u munge -- mkdir -p "$MUNGE_DIR"
    echo "$MUNGE_DIR" >"$DIR/munge.dir"
    runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
        || die "munged did not start (see $MUNGE_DIR/munged.log)"
    # munged daemonizes; its real pid is in its pid file.
    for _ in $(seq 1 50); do [ -s "$MUNGE_DIR/munged.pid" ] && break; sleep 0.1; done
    [ -s "$MUNGE_DIR/munged.pid" ] || die "munged wrote no pid file"
    cp "$MUNGE_DIR/munged.pid" "$DIR/munged.pid"
    munge --socket="$MUNGE_SOCKET" -n | unmunge --socket="$MUNGE_SOCKET" >/dev/null \
        || die "munge round trip failed"
    log "munged pid $(cat "$DIR/munged.pid"), socket $MUNGE_SOCKET"
}

start() {
    [ -e "$DIR/daemons.pid" ] && die "already started (pids in $DIR/daemons.pid); run stop first"
    mkdir -p "$DIR"
    install_packages
    rm -rf "$DIR/ctld" "$DIR/d" "$DIR/log"
    mkdir -p "$DIR/ctld" "$DIR/d" "$DIR/log"
    write_config
    export SLURM_CONF=$CONF
    [ "$AUTH" = munge ] && start_munge
    /usr/sbin/slurmctld -D -c -f "$CONF" >"$DIR/log/slurmctld.stdout" 2>&1 &
    local ctld=$!
    /usr/sbin/slurmd -D -f "$CONF" >"$DIR/log/slurmd.stdout" 2>&1 &
    local slurmd=$!
    echo "$ctld $slurmd" >"$DIR/daemons.pid"
    log "slurmctld pid $ctld, slurmd pid $slurmd"
    local state=""
    for _ in $(seq 1 120); do
        state=$(timeout 5 sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
        [ "$state" = idle ] && break
        sleep 0.5
    done
    if [ "$state" != idle ]; then
        tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
        stop
        die "the node did not become idle (state '${state:-none}')"
    fi
    log "node $(hostname -s) idle; clients need: export SLURM_CONF=$CONF"
}

stop_pid() {
    local pid=$1 name=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || { log "stopped $name ($pid)"; return 0; }; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    log "killed $name ($pid)"
}

stop() {
    if [ -s "$DIR/daemons.pid" ]; then
        read -r ctld slurmd <"$DIR/daemons.pid"
        stop_pid "$slurmd" slurmd
        stop_pid "$ctld" slurmctld
        rm -f "$DIR/daemons.pid"
    fi
    if [ -s "$DIR/munged.pid" ]; then
        stop_pid "$(cat "$DIR/munged.pid")" munged
        rm -f "$DIR/munged.pid"
    fi
    if [ -s "$DIR/munge.dir" ]; then
        rm -rf "$(cat "$DIR/munge.dir")" "$DIR/munge.dir"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
