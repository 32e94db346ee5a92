#!/usr/bin/env bash
# Train ProLIP on a SLURM GPU cluster: one trainer process per GPU, requeued on preemption.
# Settings, subcommands and examples: `bash scripts/launch_slurm.sh --help` and docs/launch.md.
set -euo pipefail

ME="launch_slurm.sh"
SUBCOMMANDS=(submit setup resume status logs stop job)
SETTINGS=(WORKDIR DATA_PATH TOKENIZER GPUS_PER_NODE NODES CONFIG DATA_SOURCE VENV PYTHON PARTITION
          ACCOUNT QOS TIME CPUS_PER_TASK JOB_NAME COORDINATOR_PORT REPO_DIR)

usage() {
  cat <<'EOF'
Usage: bash scripts/launch_slurm.sh [SUBCOMMAND] [--setting=value ...] [--dry-run] [-- TRAINER ARGS]

Subcommands (default: submit)
  setup    build the CUDA environment VENV on this (login) node: a Python >= 3.11 venv with
           `pip install -c requirements/constraints-cuda.txt -e '.[cuda]'` (jax[cuda12]).
  submit   sbatch the run: NODES x GPUS_PER_NODE processes (one per GPU, srun
           --ntasks-per-node=GPUS_PER_NODE), jax.distributed from SLURM's variables,
           --requeue, and a warning signal 120 s before the time limit on which the trainer
           saves a checkpoint and the job requeues itself. Logs: WORKDIR/slurm/.
           Refuses while a job named JOB_NAME is queued or running.
  resume   the same as submit: the trainer resumes from WORKDIR's newest checkpoint.
  status   squeue for JOB_NAME.
  logs     follow the newest log of process 0 in WORKDIR/slurm/.
  stop     SIGTERM the job (the trainer saves a checkpoint and exits; no requeue).
  job      (what sbatch runs; not for direct use)

Settings: environment variables, or flags (WORKDIR=x or --workdir=x)
  required by submit / resume
    WORKDIR         a folder every node shares: checkpoints, metrics, slurm/ logs; a
                    resubmission with the same WORKDIR resumes
    DATA_PATH       training shards, e.g. '/data/datacomp/*.array_record' (tar shards may be gs://...)
    TOKENIZER       tokenizer file, e.g. /data/tokenizers/spiece.model (or gs://...)
    GPUS_PER_NODE   GPUs on each node, e.g. 8: one process per GPU
  required by logs
    WORKDIR
  optional
    NODES           nodes [1]
    CONFIG          trainer config [configs/prolip_b16_datacomp.py]; ':arg' allowed
    DATA_SOURCE     tar or array_record [array_record for *.array_record, else tar]
    VENV            the CUDA environment [REPO_DIR/.venv-cuda, built by `setup`]
    PYTHON          the Python `setup` builds VENV from [python3.11 on PATH, else python3 if >= 3.11]
    PARTITION, ACCOUNT, QOS, TIME, CPUS_PER_TASK   passed to sbatch when set
    JOB_NAME        [prolip]
    COORDINATOR_PORT  port of process 0 for jax.distributed [20000 + job id % 10000]
    REPO_DIR        the checkout the job runs [the one holding this script]

EOF
  options_help  # the options parse_args takes, shared
  cat <<'EOF'

Example
  bash scripts/launch_slurm.sh setup
  WORKDIR=/shared/$(id -un)/prolip/b16 DATA_PATH='/data/datacomp/*.array_record' \
  TOKENIZER=/data/spiece.model GPUS_PER_NODE=8 NODES=4 bash scripts/launch_slurm.sh submit
EOF
}

# die, quote, run, options_help, parse_args and require_settings, shared with launch_tpu_pod.sh:
# beside this file in a checkout; under sbatch this file is SLURM's spool copy, elsewhere, so the job
# reads them from the checkout that `submit` passes on as --repo-dir (an absolute path).
COMMON=$(dirname "${BASH_SOURCE[0]}")/launch_common.sh
if [[ ! -f $COMMON ]]; then
  COMMON=${REPO_DIR:-}
  for arg in "$@"; do
    [[ $arg == -- ]] && break
    if [[ $arg == --repo-dir=* ]]; then COMMON=${arg#*=}; fi
  done
  COMMON=$COMMON/scripts/launch_common.sh
  [[ -f $COMMON ]] || { echo "$ME: no launch_common.sh beside this file or at $COMMON: run it from its checkout, or pass the checkout as --repo-dir" >&2; exit 2; }
fi
# shellcheck source=launch_common.sh
source "$COMMON"

# ---- arguments ---------------------------------------------------------------------------------
parse_args "$@"
# Under sbatch this file runs from SLURM's spool folder, so `submit` passes REPO_DIR on.
REPO_DIR=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
NODES=${NODES:-1}
VENV=${VENV:-$REPO_DIR/.venv-cuda}
JOB_NAME=${JOB_NAME:-prolip}

required=()
case $SUBCOMMAND in
  submit|job) required=(WORKDIR DATA_PATH TOKENIZER GPUS_PER_NODE) ;;
  logs) required=(WORKDIR) ;;
esac
require_settings ${required[@]+"${required[@]}"}
for name in NODES GPUS_PER_NODE; do
  [[ -z ${!name} || ${!name} =~ ^[1-9][0-9]*$ ]] || die "$name=${!name}: a positive whole number"
done
# The job runs from REPO_DIR: make local relative paths absolute (URLs such as gs:// stay as they are).
if [[ $SUBCOMMAND == submit ]]; then
  for name in WORKDIR DATA_PATH TOKENIZER VENV; do
    value=${!name}
    [[ $value == /* || $value =~ ^[a-z][a-z0-9+.-]*:// ]] || printf -v "$name" '%s' "$PWD/$value"
  done
fi
LOG_DIR=$WORKDIR/slurm

# Queued or running jobs of this user with this name (one id a line).
my_jobs() { squeue -h -u "$(id -un)" -n "$JOB_NAME" -o %i; }

case $SUBCOMMAND in
  setup)
    at_least_3_11() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
    # The lock (requirements/constraints*.txt) is made on 3.11; the Makefile picks the same way.
    if [[ -z $PYTHON ]]; then
      if command -v python3.11 >/dev/null; then
        PYTHON=python3.11
      elif ! command -v python3 >/dev/null; then
        die "no python3.11 or python3 on PATH: set PYTHON=/path/to/python3.11 (or load a module that has one)"
      elif at_least_3_11 python3; then
        PYTHON=python3
      else
        die "no python3.11 on PATH and python3 is $(python3 -V 2>&1 | head -n 1), older than 3.11: set PYTHON=/path/to/python3.11 (or load a module that has one)"
      fi
    elif [[ $DRY_RUN == 0 ]] && ! at_least_3_11 "$PYTHON"; then
      die "PYTHON=$PYTHON is not a Python >= 3.11: set PYTHON to one"
    fi
    if [[ ! -x $VENV/bin/python ]]; then run "$PYTHON" -m venv "$VENV"; fi
    run "$VENV/bin/python" -m pip install -q -c "$REPO_DIR/requirements/constraints-cuda.txt" -e "${REPO_DIR}[cuda]"
    echo "CUDA environment ready: $VENV"
    exit 0 ;;
  status)
    run squeue -u "$(id -un)" -n "$JOB_NAME"
    exit 0 ;;
  stop)
    # --full: the batch shell gets the signal too and passes it to srun; the trainer checkpoints.
    if [[ $DRY_RUN == 1 ]]; then run scancel --full --signal=TERM "<job id from squeue>"; exit 0; fi
    ids=$(my_jobs)
    [[ -n $ids ]] || die "no job named $JOB_NAME is queued or running"
    for id in $ids; do run scancel --full --signal=TERM "$id"; done
    exit 0 ;;
  logs)
    if [[ $DRY_RUN == 1 ]]; then run tail -n 100 -F "$LOG_DIR/<newest>-0.log"; exit 0; fi
    newest=""
    for f in "$LOG_DIR"/*-0.log; do [[ -f $f && ( -z $newest || $f -nt $newest ) ]] && newest=$f; done
    [[ -n $newest ]] || die "no process-0 log in $LOG_DIR yet"
    run tail -n 100 -F "$newest"
    exit 0 ;;
esac

TRAIN_ARGS=(--config="$CONFIG" --workdir="$WORKDIR" --config.data.source="$DATA_SOURCE"
            --config.data.path="$DATA_PATH" --config.data.tokenizer.path="$TOKENIZER")
TRAIN_ARGS+=(${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"})

if [[ $SUBCOMMAND == submit ]]; then
  [[ -x $VENV/bin/python || $DRY_RUN == 1 ]] || die "no CUDA environment at VENV=$VENV: run \`bash scripts/launch_slurm.sh setup\` or set VENV"
  [[ -f $REPO_DIR/${CONFIG%%:*} ]] || die "CONFIG=$CONFIG: no such file in $REPO_DIR"
  if [[ $DRY_RUN == 0 ]]; then
    ids=$(my_jobs)
    [[ -z $ids ]] || die "job $(echo "$ids" | head -n 1) named $JOB_NAME is already queued or running on this WORKDIR's run: watch it (logs) or stop it first"
  fi
  sbatch=(sbatch --job-name="$JOB_NAME" --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE"
          --gpus-per-node="$GPUS_PER_NODE" --requeue --signal=B:USR1@120 --open-mode=append
          --output="$LOG_DIR/%j-batch.log" --chdir="$REPO_DIR")
  for name in PARTITION ACCOUNT QOS TIME CPUS_PER_TASK; do
    if [[ -n ${!name} ]]; then flag=${name,,}; sbatch+=(--"${flag//_/-}=${!name}"); fi
  done
  job=("$REPO_DIR/scripts/launch_slurm.sh" job --repo-dir="$REPO_DIR" --venv="$VENV"
       --gpus-per-node="$GPUS_PER_NODE" --workdir="$WORKDIR" --data-path="$DATA_PATH" --tokenizer="$TOKENIZER"
       --config="$CONFIG" --data-source="$DATA_SOURCE" --job-name="$JOB_NAME")
  [[ -n $COORDINATOR_PORT ]] && job+=(--coordinator-port="$COORDINATOR_PORT")
  run mkdir -p "$LOG_DIR"
  run "${sbatch[@]}" "${job[@]}" -- ${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"}
  if [[ $DRY_RUN == 1 ]]; then
    echo "# then, inside the job (the job subcommand):"
    SUBCOMMAND=job
  else
    cat <<EOF
Submitted. Logs in $LOG_DIR (one per process: <job id>-<process>.log).
  watch:  WORKDIR=$(quote "$WORKDIR") bash scripts/launch_slurm.sh logs     (or: status)
  stop:   bash scripts/launch_slurm.sh stop     (saves a checkpoint)
  resume: the same submit command again (same WORKDIR)
EOF
    exit 0
  fi
fi

# ---- job: runs inside the allocation (sbatch runs this file with `job`) ------------------------
# jax.distributed from SLURM's variables: process 0 on the first node is the coordinator;
# every task passes its own SLURM_PROCID (expanded by the task's shell, below).
NUM_PROCESSES=${SLURM_NTASKS:-$((NODES * GPUS_PER_NODE))}
if [[ $DRY_RUN == 1 ]]; then
  echo "+ scontrol show hostnames \"\$SLURM_JOB_NODELIST\"   # the first is the coordinator"
  COORDINATOR="<first node>"
  PORT=${COORDINATOR_PORT:-"<20000 + job id % 10000>"}
else
  [[ -n ${SLURM_JOB_ID:-} ]] || die "the job subcommand runs inside sbatch (use submit)"
  [[ -x $VENV/bin/python ]] || die "no CUDA environment at VENV=$VENV on $(hostname): build it with the setup subcommand"
  cd "$REPO_DIR"
  COORDINATOR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" | head -n 1)
  [[ -n $COORDINATOR ]] || die "scontrol listed no hosts for SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}"
  PORT=${COORDINATOR_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
fi
# Each process takes GPU SLURM_LOCALID of its node (jax reads it), so every task sees all GPUs.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# srun (SLURM >= 22.05) does not inherit sbatch's --cpus-per-task by itself.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
[[ $DRY_RUN == 1 ]] || echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): $NUM_PROCESSES processes, coordinator $COORDINATOR:$PORT, workdir $WORKDIR"

# The warning signal (USR1, --signal=B:USR1@120) and SIGTERM (preemption, `stop`) are passed to
# srun, which passes SIGTERM to every process: the trainer saves a checkpoint and exits. After a
# USR1 (time limit near) the job requeues itself; a preempted job is requeued by SLURM (--requeue).
REQUEUE=0
SIGNALLED=0
SRUN_PID=""
# shellcheck disable=SC2329  # called by the traps below
on_signal() {
  SIGNALLED=1
  [[ $1 == USR1 ]] && REQUEUE=1
  echo "$ME: SIG$1: asking the trainer to checkpoint and exit"
  [[ -n $SRUN_PID ]] && kill -TERM "$SRUN_PID" 2>/dev/null || true
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# --kill-on-bad-exit: one dead process ends the step instead of leaving the rest in a collective.
# shellcheck disable=SC2016  # $0, $@ and $SLURM_PROCID are expanded by each task's shell
srun=(srun --kill-on-bad-exit=1 --ntasks-per-node="$GPUS_PER_NODE" --output="$LOG_DIR/%j-%t.log" --open-mode=append
      bash -c 'exec "$0" -m prolip_jax.train "$@" --process_id="$SLURM_PROCID"'
      "$VENV/bin/python" "${TRAIN_ARGS[@]}" --coordinator_address="$COORDINATOR:$PORT" --num_processes="$NUM_PROCESSES")
if [[ $DRY_RUN == 1 ]]; then
  run "${srun[@]}"
  echo "# on the time-limit warning (SIGUSR1), once the trainer has saved and exited:"
  echo "+ scontrol requeue \"\$SLURM_JOB_ID\""
  echo "(dry run: nothing was run)"
  exit 0
fi
echo "+ $(quote "${srun[@]}")"
"${srun[@]}" &
SRUN_PID=$!
# `wait` returns early when a trapped signal arrives; wait again for srun's own exit status.
while :; do
  SIGNALLED=0
  wait "$SRUN_PID" && status=0 || status=$?
  ((SIGNALLED)) || break
done
if [[ $REQUEUE == 1 ]]; then
  echo "$ME: requeueing job $SLURM_JOB_ID; it resumes from $WORKDIR"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
