#!/usr/bin/env bash
# Idempotent set-up shared by launch/demo.sh and launch/test.sh; source it from the repo root.
# Creates .venv, installs torch==2.13.0 (the CPU build on this machine's disk) first, then the
# pinned stack and ds_cluster itself; installs Debian's Open MPI when mpirun is missing.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

log() { printf '[setup] %s\n' "$*" >&2; }

if ! command -v mpirun >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Open MPI and iproute2 from Debian"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev iproute2 >/dev/null
  else
    log "mpirun not found and cannot apt-get install it (not root): MPI tests will be skipped"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
PY=.venv/bin/python
stamp=.venv/.ds_cluster_stamp
want="$(cat requirements-lock.txt setup.py | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    log "installing torch==2.13.0 (CPU build)"
    "$PY" -m pip install -q torch==2.13.0
  fi
  log "installing the pinned stack (requirements-lock.txt) and ds_cluster"
  "$PY" -m pip install -q -r requirements-lock.txt
  "$PY" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi

export PATH="$REPO/.venv/bin:$PATH"
# One node, loopback only. The accelerator is DeepSpeed's own choice (CUDA where a GPU is, else the CPU);
# launch/test.sh forces the CPU for the tests.
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export TORCH_EXTENSIONS_DIR="$REPO/.torch_extensions"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
