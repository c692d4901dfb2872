#!/usr/bin/env bash
# Train on several nodes through torchrun's c10d rendezvous. Run the SAME command on every node
# (any order; the agents wait for each other at the rendezvous):
#
#   RDZV_ENDPOINT=node0:29500 NNODES=2 tools/launch_multinode.sh --cfg configs/occworld_nuscenes.json \
#       --set data.root=/shared/occ3d --set run.out_dir=/shared/runs
#
# Environment:
#   RDZV_ENDPOINT  host:port of one of the nodes; its agent hosts the rendezvous store (required)
#   NNODES         number of nodes, or MIN:MAX for an elastic job (default 1)
#   NPROC          processes (GPUs) per node (default: the GPUs nvidia-smi lists)
#   RDZV_ID        job id, the same on all nodes (default wm; give each job its own when several
#                  jobs share an endpoint)
#   MAX_RESTARTS   times torchrun restarts all workers after a failure (default 3)
#
# A restart re-runs the same train.py command, and train.py resumes from the newest complete
# checkpoint, so --max-restarts gives automatic resume after a crashed or killed worker (an
# elastic job may come back on fewer nodes: the sampler continues exactly, the RNG streams are
# re-seeded). The run folder (run.out_dir) and the data (data.root, or $WM_CACHE for the
# synthetic set) must be on a filesystem every node sees: rank 0 writes, every rank reads the
# checkpoint it resumes from. NCCL tips: docs/TRAINING.md, "Several GPUs and nodes".
set -euo pipefail

: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of one node (the rendezvous store), e.g. node0:29500}"
NNODES=${NNODES:-1}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if [ -z "$NPROC" ] || [ "$NPROC" -lt 1 ]; then
    echo "error: no GPU found by nvidia-smi; set NPROC" >&2
    exit 2
fi
RDZV_ID=${RDZV_ID:-wm}
MAX_RESTARTS=${MAX_RESTARTS:-3}
# one OpenMP thread per worker unless told otherwise: the DataLoader workers do the CPU work
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

cd "$(dirname "$0")/.."
# torchrun runs in its own session, so a SIGTERM/SIGINT to this node (a preemption, SLURM's
# --signal, Ctrl-C, kill of this script's process group) reaches the training processes alone: every
# rank on every node stops at the same step, rank 0 saves, the ranks exit 0, and so do the torchrun
# agents of all nodes. (torchrun signalled itself would kill its workers and leave the other nodes'
# agents waiting for it at their exit barrier.)
set -x
setsid torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" \
    train.py "$@" &
agent=$!
set +x
trap 'pkill -TERM -P "$agent" || true' TERM INT
while kill -0 "$agent" 2>/dev/null; do
    wait "$agent" || true  # returns early when a signal is trapped
done
wait "$agent"
