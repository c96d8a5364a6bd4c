#!/usr/bin/env bash
# Launch a job with the deepspeed launcher: on one node, or on the hosts of a hostfile through Open MPI.
#
#   launch/run_deepspeed.sh [--num_gpus N | --hostfile FILE] [--script PY | --module M] [SCRIPT_ARGS...]
#
#   one node:   launch/run_deepspeed.sh --num_gpus 2 --deepspeed ds_configs/zero3.json --analysis ...
#   two hosts:  NET_IF=eth0 launch/run_deepspeed.sh --hostfile launch/hostfile.example --deepspeed ...
#
# --num_gpus N   ranks on this node (default 2; required on CPU, where the launcher would count NUMA
#                nodes instead)
# --hostfile F   DeepSpeed hostfile ("h0 slots=1" per line): runs `deepspeed --launcher openmpi`,
#                which starts the ranks with mpirun over ssh; ranks find rank 0 through mpi4py
# --script PY    a Python script to run instead of the module ds_cluster.train; SCRIPT_ARGS go to it
# --module M     a Python module to run (default ds_cluster.train)
#
# Environment: as launch/run_mpi.sh (NET_IF, MASTER_ADDR, MASTER_PORT, PYTHON); DEEPSPEED_LAUNCHER_ARGS
# adds mpirun options. The openmpi launcher forwards only PYTHON*, UCX* and .deepspeed_env entries
# itself, so the variables in launch/multinode_env.sh are passed to mpirun here, through
# --launcher_args (without --mca btl: the launcher sets that one and Open MPI refuses a repeat).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/multinode_env.sh"

nproc=2 hostfile="" target=(--module ds_cluster.train)
while [ $# -gt 0 ]; do
  case "$1" in
    --num_gpus|--num-gpus) nproc="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --script) target=("$2"); shift 2 ;;
    --module) target=(--module "$2"); shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

deepspeed_bin="$(dirname "$PYTHON")/deepspeed"
[ -x "$deepspeed_bin" ] || deepspeed_bin=deepspeed

if [ -z "$hostfile" ]; then
  exec "$deepspeed_bin" --num_gpus "$nproc" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
    --master_port "$MASTER_PORT" "${target[@]}" "$@"
fi

require_network_for_hostfile
mapfile -t launcher_args < <(network_args; forward_args)
master=()
if [ -n "${MASTER_ADDR:-}" ]; then master=(--master_addr "$MASTER_ADDR"); fi
exec "$deepspeed_bin" --hostfile "$hostfile" --launcher openmpi "${master[@]}" --master_port "$MASTER_PORT" \
  --launcher_args "${launcher_args[*]} ${DEEPSPEED_LAUNCHER_ARGS:-}" "${target[@]}" "$@"
