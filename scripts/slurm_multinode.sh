#!/usr/bin/env bash
# Multi-node memtrain under SLURM: one torchrun per node, joined by torchrun's c10d rendezvous on the
# first node of the allocation. Submit with:  sbatch scripts/slurm_multinode.sh recipes/llama-70b-64gpu.yaml
#SBATCH --job-name=memtrain
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=memtrain-%j.out
set -euo pipefail
RECIPE="${1:?usage: sbatch scripts/slurm_multinode.sh RECIPE [overrides...]}"
shift
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-8}"

# Every node runs the same command; the rendezvous assigns ranks. --max-restarts lets the group restart
# from the last checkpoint when a rank dies (memtrain resumes with --resume).
srun --kill-on-bad-exit=1 torchrun \
  --nnodes="$SLURM_JOB_NUM_NODES" \
  --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$HEAD_NODE:29500" \
  --rdzv-id="$SLURM_JOB_ID" \
  --max-restarts=1 \
  -m memtrain train "$RECIPE" --resume auto "$@"
