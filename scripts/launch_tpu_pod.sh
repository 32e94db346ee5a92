#!/usr/bin/env bash
# Launch ProLIP pretraining on a Cloud TPU pod slice (TPU VMs), one trainer process per host.
#
# Usage:   TPU_NAME=my-v4-256 ZONE=us-central2-b WORKDIR=gs://my-bucket/prolip/run1 \
#            DATA_PATH='gs://my-bucket/datacomp/train-*.array_record' \
#            bash scripts/launch_tpu_pod.sh [--config.field=value ...]
#
# `--worker=all` runs the same command on every host of the slice; inside it,
# jax.distributed.initialize() (forced by PROLIP_DISTRIBUTED=1) finds the coordinator and
# process ids from the TPU metadata, so no flags are needed. Every host must see the same code and config, hence the pull.
# The workdir should be a GCS bucket all hosts can reach: checkpoints (orbax, multi-host) and
# metrics (written by process 0) go there, and a relaunch with the same WORKDIR resumes.
# Extra arguments are passed to the trainer, e.g. --config.total_steps=1000.
set -euo pipefail

# ---- placeholders: set these (or export them before calling) -----------------------------
TPU_NAME="${TPU_NAME:-my-tpu-v4-256}"
ZONE="${ZONE:-us-central2-b}"
PROJECT="${PROJECT:-my-gcp-project}"
REPO_URL="${REPO_URL:-https://github.com/my-org/prolip_jax.git}"
BRANCH="${BRANCH:-main}"
CONFIG="${CONFIG:-configs/prolip_b16_datacomp.py}"   # append :arg for a variant, e.g. :variant=L/16
WORKDIR="${WORKDIR:-gs://my-bucket/prolip/run1}"
DATA_PATH="${DATA_PATH:-gs://my-bucket/datacomp1b/train-*.array_record}"
DATA_SOURCE="${DATA_SOURCE:-array_record}"          # or tar (webdataset shards)
TOKENIZER="${TOKENIZER:-/home/$USER/spiece.model}"  # SigLIP c4-en SentencePiece model, copied to every worker
# jax[tpu] pulls the matching libtpu from PyPI; keep the range of setup.cfg. gcsfs and
# google-cloud-storage (installed below) let metrics.jsonl and TensorBoard write to gs://.
JAX_SPEC="${JAX_SPEC:-jax[tpu]>=0.10.2,<0.12}"

# Quote the trainer's arguments once here so they survive the remote shell unchanged.
TRAIN_ARGS=$(printf '%q ' --config="$CONFIG" --workdir="$WORKDIR" --config.data.source="$DATA_SOURCE" \
  --config.data.path="$DATA_PATH" --config.data.tokenizer.path="$TOKENIZER" "$@")

# Runs on every worker: clone once, update, install, train. stdout/stderr of all workers
# stream back here; process 0 prints the progress lines, the others stay mostly quiet.
REMOTE_CMD="set -e
[ -d prolip_jax ] || git clone --branch $(printf '%q' "$BRANCH") $(printf '%q' "$REPO_URL") prolip_jax
cd prolip_jax
git fetch origin && git checkout $(printf '%q' "$BRANCH") && git pull --ff-only
python3 -m pip install -q -U $(printf '%q' "$JAX_SPEC")
python3 -m pip install -q -e . gcsfs google-cloud-storage
PROLIP_DISTRIBUTED=1 python3 -m prolip_jax.train $TRAIN_ARGS"

gcloud compute tpus tpu-vm ssh "$TPU_NAME" \
  --project "$PROJECT" --zone "$ZONE" --worker=all \
  --command "$REMOTE_CMD"

# If the ssh session may drop (laptop sleep), wrap the last line of REMOTE_CMD in
# `nohup ... > ~/prolip_train.log 2>&1 &` and follow it with `--command 'tail -f ~/prolip_train.log'`
# on --worker=0. Preempted slices (spot/queued resources): relaunch this script; the trainer
# resumes from the last checkpoint in WORKDIR.
