#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for CI: scripts/slurm_cluster.sh with one node
# (kept for the commands and CI steps that call it by this name).
#
#   scripts/slurm_single_node.sh start|stop|env     in $SLURM_CI_DIR (default /tmp/slurm-ci)
#
# See scripts/slurm_cluster.sh for what start and stop do; AUTH=none skips munge.
set -euo pipefail
case "${1:-}" in
    start) exec "$(dirname "$0")/slurm_cluster.sh" start --nodes 1 ;;
    stop|env) exec "$(dirname "$0")/slurm_cluster.sh" "$1" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
