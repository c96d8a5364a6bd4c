#!/usr/bin/env bash
# Launch a DeepSpeed job with mpirun; ranks find each other through mpi4py (ds_cluster's discovery).
#
#   launch/run_mpi.sh [-np N] [--hostfile FILE] [--script PY | --module M] [SCRIPT_ARGS...]
#
#   one node:   launch/run_mpi.sh -np 2 --deepspeed ds_configs/zero3.json --analysis runs/demo/analysis ...
#   two hosts:  NET_IF=eth0 launch/run_mpi.sh --hostfile launch/hostfile.example --deepspeed ...
#   analysis:   launch/run_mpi.sh --module ds_cluster.cli analyze --deepspeed ... --out DIR
#
# -np N          ranks (default 2 on one node; with a hostfile, the hostfile's slots)
# --hostfile F   Open MPI hostfile ("h0 slots=1" per line); hosts are reached with ssh
# --script PY    a Python script to run instead of the module ds_cluster.train; SCRIPT_ARGS go to it
# --module M     a Python module to run (default ds_cluster.train)
#
# Environment: NET_IF (interface the hosts share, default lo = one node only), MASTER_ADDR (default:
# rank 0's address on NET_IF, found over MPI), MASTER_PORT (default 29500), PYTHON (default the
# repo's .venv), MPIRUN_ARGS (more mpirun options). Forwarded to every rank: see
# launch/multinode_env.sh and launch/MULTINODE.md. mpirun is called by name on purpose: a full path
# such as /usr/bin/mpirun makes Open MPI put that folder first on the ranks' PATH.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/multinode_env.sh"

nproc="" hostfile="" target=(-m ds_cluster.train)
while [ $# -gt 0 ]; do
  case "$1" in
    -np|-n) nproc="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --script) target=("$2"); shift 2 ;;
    --module) target=(-m "$2"); shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

mpirun_args=()
if [ -n "$hostfile" ]; then
  require_network_for_hostfile
  mpirun_args+=(--hostfile "$hostfile" --mca btl self,vader,tcp)
  mapfile -t -O "${#mpirun_args[@]}" mpirun_args < <(network_args)
else
  # One node: shared memory between the ranks, Open MPI's own channel on loopback.
  nproc="${nproc:-2}"
  mpirun_args+=(--oversubscribe --mca btl self,vader --mca oob_tcp_if_include "$NET_IF")
  if [ "$(id -u)" = 0 ]; then mpirun_args+=(--allow-run-as-root); fi
fi
if [ -n "$nproc" ]; then mpirun_args=(-np "$nproc" "${mpirun_args[@]}"); fi
mapfile -t -O "${#mpirun_args[@]}" mpirun_args < <(forward_args PYTHONPATH PYTHONUNBUFFERED)
# shellcheck disable=SC2206  # MPIRUN_ARGS is a list of options, split on purpose
mpirun_args+=(${MPIRUN_ARGS:-})

exec mpirun "${mpirun_args[@]}" "$PYTHON" "${target[@]}" "$@"
