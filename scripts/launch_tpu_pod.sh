#!/usr/bin/env bash
# Train ProLIP on a Cloud TPU VM slice (one trainer process per host) from your workstation.
# Settings, subcommands and examples: `bash scripts/launch_tpu_pod.sh --help` and docs/launch.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ME="launch_tpu_pod.sh"
SUBCOMMANDS=(launch resume logs status stop delete)
# Every setting: NAME (environment variable) or --name=value (flag, lowercase with dashes).
SETTINGS=(TPU_NAME ZONE PROJECT ACCELERATOR_TYPE NUM_SLICES WORKDIR DATA_PATH TOKENIZER CONFIG DATA_SOURCE
          RUNTIME_VERSION SPOT REPO_URL BRANCH PYTHON_VERSION EXTRA_PACKAGES WORKER READY_TIMEOUT
          POLL_INTERVAL)

usage() {
  cat <<'EOF'
Usage: bash scripts/launch_tpu_pod.sh [SUBCOMMAND] [--setting=value ...] [--dry-run] [-- TRAINER ARGS]

Subcommands (default: launch)
  launch   create the TPU VM if absent (reuse it if READY; wait while it is CREATING, STARTING,
           RESTARTING, REPAIRING or DELETING; delete and create anew one that is PREEMPTED or
           TERMINATED, as those never restart), ship the code and a local tokenizer to every
           worker, build a Python 3.11 venv there with uv (`-c requirements/constraints.txt
           -e '.[tpu]'`), and start the trainer detached on every worker (log per worker:
           ~/prolip/logs/train.log on that worker). Refuses while a run is still alive.
  resume   the same as launch: the trainer resumes from WORKDIR's newest checkpoint (after a
           preemption too: the VM is recreated, WORKDIR keeps the checkpoints).
  logs     follow a worker's log (WORKER=0 by default; WORKER=all for every worker).
  status   per worker: running or not, and the log's last line.
  stop     SIGTERM the trainer on every worker: it saves a checkpoint and exits.
  delete   delete the TPU VM (the run stays in WORKDIR; `launch` later resumes it).

Settings: environment variables, or flags (TPU_NAME=x or --tpu-name=x)
  required by every subcommand
    TPU_NAME          the TPU VM's name (created by `launch` if absent); with NUM_SLICES > 1 the
                      queued resource's, its slices named TPU_NAME-0, TPU_NAME-1, ...
    ZONE              e.g. us-central2-b (v4), us-east5-a (v5p), us-west4-a (v5e)
    PROJECT           the Google Cloud project id
  required by launch / resume
    ACCELERATOR_TYPE  e.g. v4-32, v5p-64, v5litepod-16 (used when the VM is created)
    WORKDIR           gs://bucket/run: checkpoints and metrics; every worker must reach it, and
                      a relaunch with the same WORKDIR resumes
    DATA_PATH         training shards, e.g. 'gs://bucket/datacomp/{00000..09999}.tar' (passed as
                      is: a bucket, or a path that exists on every worker)
    TOKENIZER         a gs:// path (passed as is) or a local file, copied to every worker
  optional
    NUM_SLICES        slices of ACCELERATOR_TYPE joined over the data-center network [1]: above
                      1, a multislice through queued resources (`queued-resources create
                      --node-count`), one trainer per host of every slice, the data axis across
                      the slices (--config.mesh.dcn_shape="(NUM_SLICES,1,1)")
    CONFIG            trainer config [configs/prolip_b16_datacomp.py]; ':arg' allowed
    DATA_SOURCE       tar or array_record [array_record for *.array_record, else tar];
                      array_record shards must be on local disk (their reader cannot stream)
    RUNTIME_VERSION   TPU software version [from ACCELERATOR_TYPE: tpu-ubuntu2204-base for v2-v4,
                      v2-alpha-tpuv5 for v5p, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e]
    SPOT              1 creates a Spot VM [0]
    REPO_URL          git URL the workers clone; unset: this checkout's HEAD commit is shipped
    BRANCH            branch of REPO_URL [main]
    PYTHON_VERSION    the workers' Python, installed by uv [3.11]
    EXTRA_PACKAGES    also installed on the workers [gcsfs google-cloud-storage]
    WORKER            which worker `logs` follows [0]
    READY_TIMEOUT     seconds `launch` waits for a CREATING/STARTING/... VM to become READY [1800]
    POLL_INTERVAL     seconds between its state checks while waiting [30]

EOF
  options_help  # the options parse_args takes, shared
  cat <<'EOF'

Example
  TPU_NAME=prolip-v5p ZONE=us-east5-a PROJECT=my-project ACCELERATOR_TYPE=v5p-64 \
  WORKDIR=gs://my-bucket/prolip/b16 DATA_PATH='gs://my-bucket/datacomp/{00000..09999}.tar' \
  TOKENIZER=~/spiece.model bash scripts/launch_tpu_pod.sh launch
EOF
}

# die, quote, run, options_help, parse_args and require_settings, shared with launch_slurm.sh.
# shellcheck source=launch_common.sh
source "$ROOT/scripts/launch_common.sh"

# ---- arguments ---------------------------------------------------------------------------------
parse_args "$@"
SPOT=${SPOT:-0}
BRANCH=${BRANCH:-main}
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
EXTRA_PACKAGES=${EXTRA_PACKAGES:-gcsfs google-cloud-storage}
WORKER=${WORKER:-0}
NUM_SLICES=${NUM_SLICES:-1}
READY_TIMEOUT=${READY_TIMEOUT:-1800}
POLL_INTERVAL=${POLL_INTERVAL:-30}
if [[ -z $RUNTIME_VERSION ]]; then
  case $ACCELERATOR_TYPE in
    v2-*|v3-*|v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
    v5litepod-*|v5e-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
  esac
fi

required=(TPU_NAME ZONE PROJECT)
[[ $SUBCOMMAND == launch ]] && required+=(ACCELERATOR_TYPE WORKDIR DATA_PATH TOKENIZER)
notes=()
if [[ $SUBCOMMAND == launch && -n $ACCELERATOR_TYPE && -z $RUNTIME_VERSION ]]; then
  notes+=("RUNTIME_VERSION (no default for ACCELERATOR_TYPE=$ACCELERATOR_TYPE)")
fi
require_settings "${required[@]}" -- ${notes[@]+"${notes[@]}"}

[[ $NUM_SLICES =~ ^[1-9][0-9]*$ ]] || die "NUM_SLICES=$NUM_SLICES: a whole number of slices, 1 or more"
TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE" --project="$PROJECT")
# The TPU VMs: one slice, or a multislice's slices (queued resources name them PREFIX-0, -1, ...).
NODES=("$TPU_NAME")
if ((NUM_SLICES > 1)); then
  NODES=(); for ((i = 0; i < NUM_SLICES; i++)); do NODES+=("$TPU_NAME-$i"); done
fi
# `ssh`/`scp` ARGS... on every worker of every slice ($NODE in ARGS: the slice's name).
on_every_slice() {
  local verb=$1 node; shift
  for node in "${NODES[@]}"; do
    run "${TPU[@]}" "$verb" "${@//\$NODE/$node}" "${WHERE[@]}" --worker=all
  done
}
# shellcheck disable=SC2088,SC2016  # these expand on the worker, not here
RUN_DIR='~/prolip'      # on each worker: code/, venv/, assets/, logs/train.log, train.pid
# A remote command runs in the worker's login shell (bash on the TPU VM images).
# shellcheck disable=SC2016
ALIVE='[ -f ~/prolip/train.pid ] && kill -0 "$(cat ~/prolip/train.pid)" 2>/dev/null'

case $SUBCOMMAND in
  logs)
    run "${TPU[@]}" ssh "${NODES[0]}" "${WHERE[@]}" --worker="$WORKER" \
      --command="tail -n 100 -F $RUN_DIR/logs/train.log"
    exit 0 ;;
  status)
    on_every_slice ssh '$NODE' \
      --command="if $ALIVE; then s=running; else s='not running'; fi; echo \"\$(hostname): \$s | \$(tail -n 1 $RUN_DIR/logs/train.log 2>/dev/null)\""
    exit 0 ;;
  stop)
    # The trainer saves a checkpoint on SIGTERM, then exits; `launch` later resumes from it.
    on_every_slice ssh '$NODE' \
      --command="if $ALIVE; then kill -TERM \"\$(cat $RUN_DIR/train.pid)\" && echo \"\$(hostname): stopping (checkpoint, then exit)\"; else echo \"\$(hostname): not running\"; fi"
    exit 0 ;;
  delete)
    if ((NUM_SLICES > 1)); then
      run gcloud compute tpus queued-resources delete "$TPU_NAME" "${WHERE[@]}" --force --quiet
    else
      run "${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
    fi
    exit 0 ;;
esac

# ---- launch: checks before touching the cloud -------------------------------------------------
is_url() { [[ $1 =~ ^[a-z][a-z0-9+.-]*:// ]]; }
TOKENIZER=${TOKENIZER/#\~/${HOME:-~}}
if ! is_url "$TOKENIZER"; then
  [[ -f $TOKENIZER ]] || die "TOKENIZER=$TOKENIZER is neither a gs:// path nor a local file"
fi
[[ -f $ROOT/${CONFIG%%:*} ]] || die "CONFIG=$CONFIG: no such file in $ROOT"
[[ $DATA_SOURCE == tar || $DATA_SOURCE == array_record ]] || die "DATA_SOURCE=$DATA_SOURCE: use tar or array_record"
# array_record's reader cannot stream from a bucket (docs/buckets.md): refuse before creating anything.
if [[ $DATA_SOURCE == array_record ]] && is_url "$DATA_PATH"; then
  die "DATA_PATH=$DATA_PATH: array_record shards must be on each worker's local disk (copy them there and pass that path), or use tar shards, which stream from a bucket (DATA_SOURCE=tar)"
fi
[[ $SPOT == 0 || $SPOT == 1 ]] || die "SPOT=$SPOT: use 0 or 1"
[[ $READY_TIMEOUT =~ ^[0-9]+$ ]] || die "READY_TIMEOUT=$READY_TIMEOUT: a whole number of seconds"
[[ $POLL_INTERVAL =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "POLL_INTERVAL=$POLL_INTERVAL: a number of seconds"
if ! is_url "$WORKDIR"; then
  echo "$ME: note: WORKDIR=$WORKDIR is not a bucket; every worker must see it as one shared folder" >&2
fi

# ---- 1. the TPU VM: reuse a READY one, create one if absent -------------------------------------
TMP_DIR=$(mktemp -d); trap 'rm -rf "$TMP_DIR"' EXIT
describe=("${TPU[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(state)')
create=("${TPU[@]}" create "$TPU_NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR_TYPE"
        --version="$RUNTIME_VERSION")
delete=("${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet)
if ((NUM_SLICES > 1)); then  # a multislice: a queued resource of NUM_SLICES nodes
  QR=(gcloud compute tpus queued-resources)
  describe=("${QR[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(state.state)')
  create=("${QR[@]}" create "$TPU_NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR_TYPE"
          --runtime-version="$RUNTIME_VERSION" --node-count="$NUM_SLICES" --node-prefix="$TPU_NAME")
  delete=("${QR[@]}" delete "$TPU_NAME" "${WHERE[@]}" --force --quiet)
fi
[[ $SPOT == 1 ]] && create+=(--spot)

# Sets `state` to the VM's state, or to "" when the VM does not exist. Only gcloud's NOT_FOUND
# means "absent": any other failure (not logged in, no permission, a wrong PROJECT or ZONE) stops
# here, before anything is created.
read_state() {
  local rc=0 first
  state=$("${describe[@]}" 2>"$TMP_DIR/describe.err") || rc=$?
  if ((rc == 0)); then
    state=${state:-STATE_UNSPECIFIED}
    return
  fi
  if grep -qE 'NOT_FOUND|was not found' "$TMP_DIR/describe.err" \
     && ! grep -qE 'PERMISSION_DENIED|UNAUTHENTICATED' "$TMP_DIR/describe.err"; then
    state=""
    return
  fi
  first=$(grep -m 1 '^ERROR' "$TMP_DIR/describe.err" || grep -m 1 '[^[:space:]]' "$TMP_DIR/describe.err" || echo "exit status $rc, no message")
  die "cannot read TPU VM $TPU_NAME's state, so nothing was created: $first (log in with \`gcloud auth login\`, and check PROJECT=$PROJECT and ZONE=$ZONE)"
}

if [[ $DRY_RUN == 1 ]]; then
  run "${describe[@]}"
  echo "# if the TPU VM does not exist yet (one that is PREEMPTED or TERMINATED is deleted first):"
  run "${create[@]}"
else
  echo "+ $(quote "${describe[@]}")"
  deadline=$((SECONDS + READY_TIMEOUT))
  waiting_for=""
  while :; do
    read_state
    case $state in
      READY|ACTIVE)
        echo "$ME: reusing TPU VM $TPU_NAME ($state)"
        break ;;
      "")
        run "${create[@]}"
        break ;;
      PREEMPTED|TERMINATED|FAILED|SUSPENDED)
        # A preempted or terminated TPU VM (a failed or suspended queued resource) cannot be
        # started again; a new one resumes from WORKDIR.
        echo "$ME: TPU VM $TPU_NAME is $state, which never restarts: deleting it and creating it anew (the run resumes from WORKDIR)"
        run "${delete[@]}"
        run "${create[@]}"
        break ;;
      CREATING|STARTING|RESTARTING|REIMAGING|REPAIRING|UNHIDING|DELETING|ACCEPTED|WAITING_FOR_RESOURCES|PROVISIONING|SUSPENDING)
        if ((SECONDS >= deadline)); then
          die "TPU VM $TPU_NAME is still $state after ${READY_TIMEOUT} s: wait longer (READY_TIMEOUT), or delete it (bash scripts/launch_tpu_pod.sh delete) and launch again"
        fi
        if [[ $state != "$waiting_for" ]]; then
          echo "$ME: TPU VM $TPU_NAME is $state: waiting (up to ${READY_TIMEOUT} s, READY_TIMEOUT)"
          waiting_for=$state
        fi
        sleep "$POLL_INTERVAL" ;;
      STOPPED|STOPPING)
        die "TPU VM $TPU_NAME is $state: start it ($(quote "${TPU[@]}" start "$TPU_NAME" "${WHERE[@]}")) or delete it (bash scripts/launch_tpu_pod.sh delete), then launch again" ;;
      *)
        die "TPU VM $TPU_NAME is $state, which does not become READY by itself: delete it (bash scripts/launch_tpu_pod.sh delete) and launch again" ;;
    esac
  done
fi

# ---- 2. code and tokenizer to every worker -------------------------------------------------------
setup=("set -e" "if $ALIVE; then echo \"\$(hostname): a run is still alive (stop it first)\" >&2; exit 3; fi"
       "mkdir -p $RUN_DIR/logs $RUN_DIR/assets")
if [[ -z $REPO_URL ]]; then
  commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) || die "$ROOT is not a git checkout: set REPO_URL for the workers to clone"
  if [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no) ]]; then
    echo "$ME: note: shipping commit $commit; uncommitted changes stay here" >&2
  fi
  run git -C "$ROOT" archive --format=tar.gz -o "$TMP_DIR/prolip-code.tar.gz" HEAD
  on_every_slice scp "$TMP_DIR/prolip-code.tar.gz" '$NODE:prolip-code.tar.gz'
  setup+=("rm -rf $RUN_DIR/code && mkdir $RUN_DIR/code && tar -xzf ~/prolip-code.tar.gz -C $RUN_DIR/code")
else
  q_url=$(printf '%q' "$REPO_URL"); q_branch=$(printf '%q' "$BRANCH")
  setup+=("if [ -d $RUN_DIR/code/.git ]; then git -C $RUN_DIR/code fetch -q origin $q_branch && git -C $RUN_DIR/code checkout -q -B $q_branch FETCH_HEAD; else rm -rf $RUN_DIR/code && git clone -q --branch $q_branch $q_url $RUN_DIR/code; fi")
fi
tokenizer_arg=$TOKENIZER
if ! is_url "$TOKENIZER"; then
  base=$(basename "$TOKENIZER")
  on_every_slice scp "$TOKENIZER" "\$NODE:prolip-tokenizer-$base"
  setup+=("mv -f ~/prolip-tokenizer-$(printf '%q' "$base") $RUN_DIR/assets/$(printf '%q' "$base")")
  tokenizer_arg="\$HOME/prolip/assets/$base"     # expanded on the worker
fi

# ---- 3. Python >= 3.11 on every worker (uv: no root, no apt; the images ship 3.10) -------------
q_extra=$(for p in $EXTRA_PACKAGES; do printf '%q ' "$p"; done)
# shellcheck disable=SC2016
setup+=('export PATH="$HOME/.local/bin:$PATH"'
        "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh"
        "[ -x $RUN_DIR/venv/bin/python ] || uv venv -q --python $(printf '%q' "$PYTHON_VERSION") $RUN_DIR/venv"
        "cd $RUN_DIR/code && uv pip install -q --python $RUN_DIR/venv/bin/python -c requirements/constraints.txt -e '.[tpu]' ${q_extra% }"
        "echo \"\$(hostname): ready\"")
setup_cmd=$(printf '%s; ' "${setup[@]}")
on_every_slice ssh '$NODE' --command="${setup_cmd%; }"

# ---- 4. train, detached, on every worker ---------------------------------------------------------
# PROLIP_DISTRIBUTED=1: the trainer calls jax.distributed.initialize(), which reads the slice's
# hosts from the TPU metadata (a multislice's too: queued resources set MEGASCALE_* there).
# setsid + nohup: the run outlives the ssh session.
train_args=(--config="$CONFIG" --workdir="$WORKDIR" --config.data.source="$DATA_SOURCE"
            --config.data.path="$DATA_PATH")
((NUM_SLICES > 1)) && train_args+=("--config.mesh.dcn_shape=($NUM_SLICES,1,1)")
train_args+=(${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"})
q_args=$(printf '%q ' "${train_args[@]}")
if is_url "$TOKENIZER"; then
  q_args+=$(printf '%q' "--config.data.tokenizer.path=$tokenizer_arg")
else
  q_args+="--config.data.tokenizer.path=\"$tokenizer_arg\""
fi
start="cd $RUN_DIR/code; echo \"=== \$(date -u +%FT%TZ) start\" >> $RUN_DIR/logs/train.log; PROLIP_DISTRIBUTED=1 setsid nohup $RUN_DIR/venv/bin/python -m prolip_jax.train $q_args >> $RUN_DIR/logs/train.log 2>&1 < /dev/null & echo \$! > $RUN_DIR/train.pid; echo \"\$(hostname): training (pid \$(cat $RUN_DIR/train.pid)), log $RUN_DIR/logs/train.log\""
on_every_slice ssh '$NODE' --command="$start"

if [[ $DRY_RUN == 1 ]]; then echo "(dry run: nothing was run)"; exit 0; fi
settings="TPU_NAME=$(quote "$TPU_NAME") ZONE=$(quote "$ZONE") PROJECT=$(quote "$PROJECT")"
cat <<EOF
Started on every worker of $TPU_NAME; checkpoints and metrics in $WORKDIR.
  watch:  $settings bash scripts/launch_tpu_pod.sh logs      (status: every worker)
  stop:   $settings bash scripts/launch_tpu_pod.sh stop      (saves a checkpoint)
  resume: the same launch command again (same WORKDIR)
EOF
