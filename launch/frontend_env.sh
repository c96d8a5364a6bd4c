#!/usr/bin/env bash
# Build (or check) the virtual environment of one fine-tuning frontend, apart from ds_cluster's own .venv:
#   bash launch/frontend_env.sh axolotl        -> .venv-axolotl       (axolotl 0.19.0)
#   bash launch/frontend_env.sh llamafactory   -> .venv-llamafactory  (LLaMA-Factory 0.9.5)
# Neither frontend fits ds_cluster's pinned stack (requirements-lock.txt): each has its own, pinned package by
# package in launch/frontends/<name>.txt, with torch 2.13.0 (the CPU build on this machine's disk, as in
# launch/setup_env.sh) from launch/frontends/constraints.txt. ds_cluster is installed editable into each. The
# LLaMA-Factory environment gets launch/frontends/stand_in/torchaudio in place of torchaudio (no release matches
# torch 2.13.0; LLaMA-Factory imports it at start-up; text training never calls it). Idempotent: a stamp of the
# inputs skips a build that is up to date. Prints the environment's folder.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

name="${1:-}"
case "$name" in
  axolotl|llamafactory) ;;
  *) echo "usage: bash launch/frontend_env.sh axolotl|llamafactory" >&2; exit 2 ;;
esac
log() { printf '[frontend_env %s] %s\n' "$name" "$*" >&2; }

venv=".venv-$name"
lock="launch/frontends/$name.txt"
constraints="launch/frontends/constraints.txt"
stamp="$venv/.ds_cluster_stamp"
want="$(cat "$lock" "$constraints" setup.py launch/frontend_env.sh launch/frontends/stand_in/torchaudio/__init__.py \
        | sha256sum | cut -c1-16)"

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  started=$SECONDS
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
  fi
  PY="$venv/bin/python"
  log "installing torch 2.13.0 (CPU build) and the pinned packages of $lock"
  "$PY" -m pip install -q -c "$constraints" torch==2.13.0
  # Every package is pinned in the lock, so no resolution: exactly the set that was tested.
  "$PY" -m pip install -q --no-deps -c "$constraints" -r "$lock"
  "$PY" -m pip install -q --no-deps -e .
  if [ "$name" = llamafactory ]; then
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -m pip uninstall -q -y torchaudio torchvision >/dev/null 2>&1 || true
    rm -rf "$site/torchaudio"
    cp -r launch/frontends/stand_in/torchaudio "$site/torchaudio"
  fi
  echo "$want" > "$stamp"
  log "built in $((SECONDS - started)) s"
fi
echo "$REPO/$venv"
