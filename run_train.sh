#!/usr/bin/env bash
# Train with torchacco:  ./run_train.sh --config train_configs/default.toml [--section.key VALUE ...]
# Check a config for a cluster first:  ./run_train.sh --config FILE --dry-run 4x8  (nodes x GPUs per node; exit 1
#   when it does not fit, unless --dry-run-report-only)
# Config keys:  ./run_train.sh --help [SECTION]   (every key: docs/configuration.md)
#
# Environment:
#   NGPU / NPROC     processes on this node (default: all GPUs with CUDA, else 2 CPU processes)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node rendezvous (torchrun c10d)
#   RDZV_TIMEOUT     seconds to wait for every node to join (default 600)
#   TORCHACCO_REPLICA, TORCHFT_LIGHTHOUSE   this job is replica r of a fault-tolerant DiLoCo run (with MASTER_ADDR)
#   MAX_RESTARTS     restart the workers this many times after a failure; each restart resumes
#                    from the latest checkpoint (default 0)
#   PYTHON           the interpreter to use (default: python3, or the project's .venv once made)
#   INSTALL=1        (re)install into ./.venv first; otherwise install.sh runs only where no environment exists
#                    (one node, with network)
#   RANK_LOGS=0      keep torchrun's console as it is: no <dump_folder>/logs/rank_N.{out,err}, no [rankN] prefixes
#   DRY=1            print the torchrun command and start nothing (scripts/slurm/train.sbatch checks with it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
# Finds the packages without importing them (importing torch costs seconds).
CHECK="import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
  ('torch', 'torchdata', 'tokenizers', 'safetensors', 'tensorboard', 'torchacco', 'torchacco.models', 'torchacco.data')))"

# Installs only when asked (INSTALL=1) or when no environment exists: the nodes of a job share one .venv, and compute
# nodes are often offline.
if [ "${INSTALL:-0}" = 1 ]; then
  "$ROOT/install.sh"
  PY="$ROOT/.venv/bin/python"
elif ! "$PY" -c "$CHECK" 2>/dev/null; then
  if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c "$CHECK" 2>/dev/null; then
    PY="$ROOT/.venv/bin/python"
  elif [ -e "$ROOT/.venv" ] || [ "${NNODES:-1}" != 1 ]; then  # (nodes installing at once would race)
    WHAT=$([ -e "$ROOT/.venv" ] && echo "$ROOT/.venv lacks torchacco's packages" || echo "no environment here")
    echo "torchacco: error: $WHAT; run INSTALL=1 ./run_train.sh (or ./install.sh) once, on one node with network" >&2
    exit 1
  elif ! timeout 30 "$PY" -m pip index versions tomli >/dev/null 2>&1; then  # pip's own index, as configured
    echo "torchacco: error: no environment with torchacco's packages, and no network here to install one" \
      "(pip cannot reach its package index); run ./install.sh on a node with network" >&2
    exit 1
  else
    "$ROOT/install.sh"
    PY="$ROOT/.venv/bin/python"
  fi
fi

# --dry-run NODESxGPUS (torchacco/planning/dry_run.py) checks the config for that cluster and starts no worker.
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then  # this header, then the config's sections (or one's keys)
    sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0" && exec "$PY" -m torchacco config "$@"
  fi
  if [ "$arg" = "--dry-run" ] || [[ "$arg" == --dry-run=* ]]; then
    exec "$PY" -m torchacco dry-run "$@"
  fi
done

NNODES="${NNODES:-1}"
for var in NNODES NPROC NGPU NODE_RANK MAX_RESTARTS RDZV_TIMEOUT MASTER_PORT; do
  value="${!var:-0}"
  if ! [[ "$value" =~ ^[0-9]+$ ]]; then
    echo "torchacco: error: $var=$value is not a whole number; set it to e.g. $var=1" >&2
    exit 1
  fi
done
for var in NNODES NPROC NGPU RDZV_TIMEOUT MASTER_PORT; do  # these, when set, count from 1
  if [ -n "${!var:-}" ] && [ "$((10#${!var}))" -lt 1 ]; then
    echo "torchacco: error: $var=${!var} must be at least 1; set it to e.g. $var=1" >&2
    exit 1
  fi
done
if [ -n "${MASTER_PORT:-}" ] && [ "$((10#$MASTER_PORT))" -gt 65535 ]; then
  echo "torchacco: error: MASTER_PORT=$MASTER_PORT is not a TCP port; set it between 1024 and 65535" >&2
  exit 1
fi
if [ -z "${NPROC:-${NGPU:-}}" ]; then
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  NPROC=$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)
else
  NPROC="${NPROC:-$NGPU}"
fi

if [ "$NNODES" -gt 1 ] || [ -n "${TORCHACCO_REPLICA:-}" ]; then
  # (a fault-tolerant replica's job: the other replicas reach its node 0 at MASTER_ADDR, so not loopback)
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 for a multi-node run or a fault-tolerant replica job}"
  RDZV=(--nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" --rdzv_backend c10d
        --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-torchacco}"
        --rdzv_conf "join_timeout=${RDZV_TIMEOUT:-600}")
else
  RDZV=(--standalone --nnodes 1)
fi
LAUNCH=("$PY" -m torchacco.launch "${RDZV[@]}" --nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}")
if [ "${DRY:-0}" = 1 ]; then
  SHOWN=$(printf '%q ' "${LAUNCH[@]}" -m torchacco.train "$@")  # quoted as a shell would need it
  echo "${SHOWN% }"
  exit 0
fi
exec "${LAUNCH[@]}" -m torchacco.train "$@"
