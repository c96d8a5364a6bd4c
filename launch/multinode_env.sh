#!/usr/bin/env bash
# Shared by launch/run_mpi.sh and launch/run_deepspeed.sh (sourced, not run): the environment a job
# needs on every host, the list of variables mpirun must forward to remote ranks, and the
# interface options for Open MPI. Remote ranks start with the environment of a fresh ssh login, so
# everything below reaches them only through `mpirun -x NAME`.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The interpreter and tools every host runs: the repo's venv when there is one. The venv's bin goes
# first on PATH (forwarded below) so the ranks find its ninja and DeepSpeed does not rebuild its ops.
if [ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ]; then
  PYTHON="$REPO/.venv/bin/python"
fi
PYTHON="${PYTHON:-$(command -v python3)}"
PATH="$(dirname "$PYTHON"):$PATH"
export PATH
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# JIT-built DeepSpeed ops on the shared filesystem: built once, found by every host.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.torch_extensions}"
# NET_IF: the interface the ranks reach each other on (gloo and Open MPI). Loopback reaches only this
# machine, so a multi-host job must name a real one (eth0, ib0, ...).
NET_IF="${NET_IF:-${GLOO_SOCKET_IFNAME:-lo}}"
export GLOO_SOCKET_IFNAME="$NET_IF"
# Without MASTER_ADDR, ds_cluster's MPI discovery takes rank 0's address on GLOO_SOCKET_IFNAME.
export MASTER_PORT="${MASTER_PORT:-29500}"

# Variables every rank needs, forwarded with -x when set. PYTHON* are left to the caller's choice
# (the deepspeed runner forwards those itself).
FORWARDED_VARS=(PATH LD_LIBRARY_PATH DS_ACCELERATOR MASTER_ADDR MASTER_PORT GLOO_SOCKET_IFNAME
                TORCH_EXTENSIONS_DIR OMP_NUM_THREADS TOKENIZERS_PARALLELISM)
for var in $(compgen -e); do
  case "$var" in HF_*_OFFLINE|TRANSFORMERS_OFFLINE) FORWARDED_VARS+=("$var") ;; esac
done

# forward_args [EXTRA_VAR...]: `-x NAME` for each forwarded variable that is set.
forward_args() {
  local var
  for var in "${FORWARDED_VARS[@]}" "$@"; do
    if [ -n "${!var+set}" ]; then printf -- '-x\n%s\n' "$var"; fi
  done
}

# Open MPI's out-of-band channel and TCP transport on NET_IF (multi-host jobs).
network_args() {
  printf -- '--mca\noob_tcp_if_include\n%s\n--mca\nbtl_tcp_if_include\n%s\n' "$NET_IF" "$NET_IF"
  if [ "$(id -u)" = 0 ]; then printf -- '--allow-run-as-root\n'; fi
}

# require_network_for_hostfile: loopback cannot join hosts; say so before anything starts.
require_network_for_hostfile() {
  if [ "$NET_IF" = lo ]; then
    echo "$(basename "$0"): --hostfile given but NET_IF is lo; set NET_IF to the interface the hosts" \
         "share (e.g. NET_IF=eth0)" >&2
    exit 2
  fi
  case "${MASTER_ADDR:-}" in
    127.*|localhost)
      echo "$(basename "$0"): --hostfile given but MASTER_ADDR=$MASTER_ADDR is loopback; unset it (rank 0's" \
           "address on NET_IF is found over MPI) or set rank 0's address" >&2
      exit 2 ;;
  esac
}
