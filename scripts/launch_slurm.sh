#!/usr/bin/env bash
# Launch ProLIP pretraining on a SLURM GPU cluster: NODES nodes x 8 GPUs.
#
# Usage:   sbatch --nodes=4 scripts/launch_slurm.sh [--config.field=value ...]
#   (or edit the #SBATCH lines below; WORKDIR / DATA_PATH / CONFIG can be exported first.)
#
# One process per GPU (ntasks-per-node=8): srun starts them all, and
# jax.distributed.initialize() reads SLURM_* variables for the coordinator address, the
# process count and each process id, so the trainer needs no distributed flags. Each process
# then uses GPU number SLURM_LOCALID of its node, so every task must see all 8 GPUs: do not
# add --gpus-per-task=1 or a per-task CUDA_VISIBLE_DEVICES. The
# paper's B/16 run is 4 nodes x 8 H100 = 32 GPUs with a global batch of 16,384.
# WORKDIR must be on a file system every node shares; a resubmission with the same WORKDIR
# resumes from the last checkpoint. SLURM sends SIGTERM before a time limit or preemption
# (see --signal below); the trainer saves a checkpoint and exits cleanly on it.
#
#SBATCH --job-name=prolip-b16
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=72:00:00
#SBATCH --signal=TERM@300
#SBATCH --output=%x-%j.out
set -euo pipefail

# ---- placeholders: set these (or export them before sbatch) ------------------------------
REPO_DIR="${REPO_DIR:-$HOME/prolip_jax}"      # a checkout with `pip install -e .` done
VENV="${VENV:-$REPO_DIR/.venv}"               # venv with jax[cuda] installed
CONFIG="${CONFIG:-configs/prolip_b16_datacomp.py}"   # append :arg for a variant, e.g. :variant=L/16
WORKDIR="${WORKDIR:-/shared/$USER/prolip/run1}"
DATA_PATH="${DATA_PATH:-/shared/datasets/datacomp1b/train-*.array_record}"
DATA_SOURCE="${DATA_SOURCE:-array_record}"                    # or tar (webdataset shards)
TOKENIZER="${TOKENIZER:-/shared/tokenizers/siglip_c4_en/spiece.model}"

cd "$REPO_DIR"
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# Let XLA take most of each GPU's memory up front (JAX's default is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"

echo "nodes: $SLURM_JOB_NODELIST  tasks: $SLURM_NTASKS  workdir: $WORKDIR"
# --kill-on-bad-exit: one dead process takes the job down instead of leaving the rest
# waiting forever in a collective.
srun --kill-on-bad-exit=1 \
  python -m prolip_jax.train \
    --config="$CONFIG" \
    --workdir="$WORKDIR" \
    --config.data.source="$DATA_SOURCE" \
    --config.data.path="$DATA_PATH" \
    --config.data.tokenizer.path="$TOKENIZER" \
    "$@"
