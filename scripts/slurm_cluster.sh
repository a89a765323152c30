#!/usr/bin/env bash
# A real Slurm cluster of one or more nodes on this one machine, for CI: Debian's slurmctld,
# one slurmd per node and munge, started by hand (no systemd), stopped by pid.
#
#   scripts/slurm_cluster.sh start [--nodes N] [--dir D]   install the packages if missing,
#                         write the config, start munged, slurmctld and N slurmd, wait for "idle"
#   scripts/slurm_cluster.sh stop [--dir D]        stop everything start made (daemons, the
#                         nodes' jobs, their namespaces and mounts) and check nothing is left
#   scripts/slurm_cluster.sh kill-node NAME [--dir D]    a lost node: SIGKILL its slurmd and
#                         every process on it (job steps, ranks), without telling slurmctld
#   scripts/slurm_cluster.sh start-node NAME [--dir D]   bring a killed node back
#   scripts/slurm_cluster.sh env [--dir D]         print the SLURM_CONF line clients need
#
# Nodes: node1..nodeN, each with its own hostname and address, as separate machines would
# have: its slurmd runs in its own UTS namespace (hostname nodeK) and mount namespace, where
# $DIR/hosts (this machine's /etc/hosts plus one line per node) is bind-mounted on /etc/hosts,
# so every process a node starts (the batch script, the ranks) sees its node's hostname and
# can resolve the others'. Addresses are loopback ones, 127.0.X.K (X from $DIR, so two clusters
# differ); nothing else on the network is touched. Each slurmd listens on its own free port
# (Port= on its NodeName line, slurmd -N). The namespaces and the bind mount live exactly as
# long as the node's processes: killing them removes both, nothing to unmount.
# 2 CPUs per node from Slurm's point of view (SLURM_CI_CPUS_PER_NODE), so a 4-rank job spans 2.
#
# Everything lives in $DIR (--dir, or $SLURM_CI_DIR, default /tmp/slurm-ci): slurm.conf,
# state, spool, logs and pid files. /etc/slurm is not touched: clients and daemons read
# $DIR/slurm.conf through SLURM_CONF. munged gets its own socket, so two instances (another
# test session, a Slurm already on the machine) do not collide. start refuses a directory
# whose cluster is running. Needs root (apt-get, namespaces, daemons as root). AUTH=none
# skips munge. Facts behind every choice: ../shared/notes/slurm-single-node.md (Debian 12,
# Slurm 22.05).
set -euo pipefail

usage() { echo "usage: $0 start [--nodes N] [--dir D] | stop [--dir D] | kill-node NAME [--dir D] | start-node NAME [--dir D] | env [--dir D]" >&2; exit 2; }

COMMAND=${1:-}; shift || true
NODE_ARG=""
NODES=1
DIR=${SLURM_CI_DIR:-/tmp/slurm-ci}
case "$COMMAND" in kill-node|start-node) NODE_ARG=${1:-}; shift || true ;; esac
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
        --dir) DIR=${2:?--dir needs a directory}; shift 2 ;;
        *) usage ;;
    esac
done
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || { echo "[slurm-ci] ERROR: --nodes $NODES: give 1 to 99" >&2; exit 2; }
DIR=$(realpath -m "$DIR")
AUTH=${AUTH:-munge}
CPUS_PER_NODE=${SLURM_CI_CPUS_PER_NODE:-2}
CONF=$DIR/slurm.conf
TAG=$(echo -n "$DIR" | md5sum | cut -c1-12)   # unique to this instance (its $DIR)
MUNGE_DIR=/run/munge/ci-$TAG                   # short enough for a socket path
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
NET=$(( 16#${TAG:0:4} % 200 + 20 ))           # 127.0.$NET.K: this cluster's node addresses
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

TAKEN_PORTS=" "
free_port() {   # a port nothing listens on, from a range clear of the usual ephemeral ports
    local p
    for _ in $(seq 1 400); do
        p=$(( 20000 + RANDOM % 12000 ))
        [[ "$TAKEN_PORTS" == *" $p "* ]] && continue
        port_free "$p" && { TAKEN_PORTS+="$p "; echo "$p"; return; }
    done
    die "no free port found"
}

node_names() { local k; for k in $(seq 1 "$(cat "$DIR/nodes")"); do echo "node$k"; done; }
node_addr() { echo "127.0.$NET.${1#node}"; }

write_config() {
    local mem ctld_port names
    ctld_port=$(free_port)
    TAKEN_PORTS+="$ctld_port "
    mem=$(( ($(free -m | awk '/^Mem:/{print $2}') - 1024) / NODES ))
    names="node[1-$NODES]"; [ "$NODES" -eq 1 ] && names=node1
    cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: $NODES node(s) on one machine, root daemons, no
# accounting, no cgroups.
ClusterName=ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ctld_port}
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
# the nodes' CPUs are the config's (SLURM_CI_CPUS_PER_NODE), not what slurmd finds
SlurmdParameters=config_overrides
MinJobAge=600
# a lost node is declared DOWN after SlurmdTimeout (default 300 s)
SlurmdTimeout=${SLURM_CI_SLURMD_TIMEOUT:-30}
# job ids (and so the jobs' MASTER_PORTs) differ between two clusters on this machine
FirstJobId=$(( ctld_port * 10 ))
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/d/%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
EOF
    local name
    cp /etc/hosts "$DIR/hosts"
    echo "# the nodes of the cluster in $DIR (scripts/slurm_cluster.sh)" >>"$DIR/hosts"
    for k in $(seq 1 "$NODES"); do
        name=node$k
        echo "NodeName=$name NodeHostname=$name NodeAddr=$(node_addr $name) Port=$(free_port)" \
            "CPUs=$CPUS_PER_NODE RealMemory=$mem State=UNKNOWN" >>"$CONF"
        echo "$(node_addr $name) $name" >>"$DIR/hosts"
    done
    echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF"
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

start_node() {   # slurmd of node $1 in its own UTS + mount namespace; records pid and namespace
    local name=$1 pid
    mkdir -p "$DIR/d/$name"
    SLURM_CONF=$CONF unshare --uts --mount --propagation private -- bash -c \
        'hostname "$1" && mount --bind "$2" /etc/hosts && exec /usr/sbin/slurmd -D -N "$1" -f "$3"' \
        node "$name" "$DIR/hosts" "$CONF" >"$DIR/log/slurmd-$name.stdout" 2>&1 &
    pid=$!
    echo "$pid" >"$DIR/node-$name.pid"
    # the namespace's id: stop and kill-node end every process in it, not only slurmd.
    # Up to 60 s: on a loaded machine unshare, hostname, mount and exec take seconds
    for _ in $(seq 1 600); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] \
        || { cat "$DIR/log/slurmd-$name.stdout" >&2; die "slurmd of $name did not start (unshare needs root and namespaces)"; }
    readlink "/proc/$pid/ns/uts" >"$DIR/node-$name.ns"
    log "$name: slurmd pid $pid, hostname $name, address $(node_addr "$name")"
}

node_states() { timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true; }

wait_idle() {   # every node named in $@ idle
    local states=""
    for _ in $(seq 1 360); do   # 3 min: slurmd registers slowly on a loaded machine
        states=$(node_states)
        local all=1
        for n in "$@"; do grep -qx "$n idle" <<<"$states" || all=0; done
        [ $all -eq 1 ] && return 0
        sleep 0.5
    done
    echo "$states" >&2
    return 1
}

start() {
    if [ -e "$DIR/daemons.pid" ]; then
        die "a cluster is already running in $DIR (pids in $DIR/daemons.pid): run stop --dir $DIR first, or use another --dir"
    fi
    [ "$(id -u)" -eq 0 ] || die "start needs root (packages, namespaces, daemons)"
    mkdir -p "$DIR"
    install_packages
    rm -rf "$DIR/ctld" "$DIR/d" "$DIR/log"
    mkdir -p "$DIR/ctld" "$DIR/d" "$DIR/log"
    echo "$NODES" >"$DIR/nodes"
    write_config
    export SLURM_CONF=$CONF
    [ "$AUTH" = munge ] && start_munge
    /usr/sbin/slurmctld -D -c -f "$CONF" >"$DIR/log/slurmctld.stdout" 2>&1 &
    local ctld=$!
    echo "$ctld" >"$DIR/daemons.pid"
    log "slurmctld pid $ctld"
    local name
    for name in $(node_names); do
        start_node "$name"
        echo "$ctld $(cat "$DIR"/node-node*.pid | tr '\n' ' ')" >"$DIR/daemons.pid"
    done
    # shellcheck disable=SC2046
    if ! wait_idle $(node_names); then
        tail -20 "$DIR/log/slurmctld.log" "$DIR"/log/slurmd-*.log >&2 || true
        stop
        die "the nodes did not become idle"
    fi
    log "$NODES node(s) idle: $(node_names | tr '\n' ' '); clients need: export SLURM_CONF=$CONF"
}

stop_pid() {
    local pid=$1 name=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || { log "stopped $name ($pid)"; return 0; }; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    log "killed $name ($pid)"
}

ns_members() {   # pids of this cluster's processes in the namespace $1 (a readlink of /proc/PID/ns/uts)
    # One stat for all processes (a readlink each takes seconds on a loaded machine). A
    # namespace's id is reused once it has ended: a node whose processes all died (its slurmd
    # stopped) leaves a stale id that another cluster's new node may get a second later, and
    # stop or kill-node would kill that node (seen: a parallel session's stop killed this
    # cluster's node1). So a member must also see this cluster's hosts file on /etc/hosts.
    local p
    for p in $(QUOTING_STYLE=shell-always stat -c '%N' /proc/[0-9]*/ns/uts 2>/dev/null \
        | awk -v ns="'$1'" '$3 == ns { split($1, part, "/"); print part[3] }'); do
        [ /proc/"$p"/root/etc/hosts -ef "$DIR/hosts" ] && echo "$p"
    done
    return 0
}

kill_node() {   # SIGKILL every process of node $1 (its namespace dies with the last of them)
    local name=$1 ns pids end
    [ -s "$DIR/node-$name.ns" ] || die "no node $name in $DIR"
    ns=$(cat "$DIR/node-$name.ns")
    # up to SLURM_CI_KILL_WAIT_S (60 s) of wall clock: on a loaded machine a killed rank's
    # memory (or its write in progress) takes seconds to be released
    end=$(( SECONDS + ${SLURM_CI_KILL_WAIT_S:-60} ))
    while :; do
        pids=$(ns_members "$ns")
        [ -z "$pids" ] && { log "$name: no process left"; return 0; }
        [ "$SECONDS" -ge "$end" ] && break
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    # shellcheck disable=SC2086
    ps -o pid=,stat=,wchan:24=,etime=,args= -p "$(echo $pids | tr ' ' ',')" >&2 || true
    die "$name: processes survive SIGKILL for ${SLURM_CI_KILL_WAIT_S:-60} s: $pids (above: state, wait channel)"
}

stop() {
    local name
    if [ -s "$DIR/nodes" ]; then
        for name in $(node_names); do
            [ -s "$DIR/node-$name.pid" ] && stop_pid "$(cat "$DIR/node-$name.pid")" "slurmd of $name"
            # the node's job steps and ranks too (linuxproc: slurmd does not take them along)
            [ -s "$DIR/node-$name.ns" ] && kill_node "$name"
            rm -f "$DIR/node-$name.pid" "$DIR/node-$name.ns"
        done
    fi
    if [ -s "$DIR/daemons.pid" ]; then
        stop_pid "$(cut -d' ' -f1 "$DIR/daemons.pid")" slurmctld
    fi
    rm -f "$DIR/daemons.pid"
    if [ -s "$DIR/munged.pid" ]; then
        stop_pid "$(cat "$DIR/munged.pid")" munged
        rm -f "$DIR/munged.pid"
    fi
    if [ -s "$DIR/munge.dir" ]; then
        rm -rf "$(cat "$DIR/munge.dir")" "$DIR/munge.dir"
    fi
}

case "$COMMAND" in
    start) start ;;
    stop) stop ;;
    kill-node) [ -n "$NODE_ARG" ] || usage; kill_node "$NODE_ARG" ;;
    start-node)
        [ -n "$NODE_ARG" ] || usage
        [ -s "$DIR/daemons.pid" ] || die "no cluster running in $DIR"
        [ -s "$DIR/node-$NODE_ARG.ns" ] && [ -n "$(ns_members "$(cat "$DIR/node-$NODE_ARG.ns")")" ] \
            && die "$NODE_ARG is running"
        export SLURM_CONF=$CONF
        start_node "$NODE_ARG"
        ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) usage ;;
esac
