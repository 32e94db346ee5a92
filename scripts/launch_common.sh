# Sourced by launch_tpu_pod.sh and launch_slurm.sh, not run: what the two launchers share.
# The caller sets ME (its name in messages), SETTINGS (every setting's NAME), SUBCOMMANDS (the
# first is the default, and `resume` means it) and usage() before calling parse_args "$@".

die() { echo "$ME: $*" >&2; exit 2; }

# Shell-quote for printing: plain words as they are, the rest in single quotes.
quote() {
  local out="" a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@,+%~-]+$ ]]; then out+="$a "; else out+="'${a//"'"/"'\\''"}' "; fi
  done
  printf '%s' "${out% }"
}

DRY_RUN=0
run() {
  echo "+ $(quote "$@")"
  if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}

# The Options part of usage(): what parse_args takes besides settings and subcommands.
options_help() {
  cat <<'EOF'
Options
  --dry-run      print every command, run none
  -h, --help     this text
  -- ARGS        passed to the trainer, e.g. -- --config.total_steps=1000
                 (--config.x=y arguments are passed on without the --)
EOF
}

# Arguments -> SUBCOMMAND, DRY_RUN, TRAIN_EXTRA and the settings (--name=value sets NAME).
parse_args() {
  local arg name sub seen_sub=0
  SUBCOMMAND=${SUBCOMMANDS[0]}
  TRAIN_EXTRA=()
  while (($#)); do
    arg=$1; shift
    case $arg in
      -h|--help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --) TRAIN_EXTRA+=("$@"); break ;;
      --config.*) TRAIN_EXTRA+=("$arg") ;;
      --*=*)
        name=${arg%%=*}; name=${name#--}; name=${name//-/_}; name=${name^^}
        [[ " ${SETTINGS[*]} " == *" $name "* ]] || die "unknown option ${arg%%=*} (see --help)"
        printf -v "$name" '%s' "${arg#*=}" ;;
      *)
        for sub in "${SUBCOMMANDS[@]}" ""; do [[ $arg == "$sub" ]] && break; done  # "": none matched
        [[ -n $sub ]] || die "unknown argument '$arg' (see --help)"
        ((seen_sub == 0)) || die "one subcommand at a time (got '$SUBCOMMAND' and '$arg')"
        SUBCOMMAND=$arg; seen_sub=1 ;;
    esac
  done
  if [[ $SUBCOMMAND == resume ]]; then SUBCOMMAND=${SUBCOMMANDS[0]}; fi

  # Settings left unset read as empty (set -u), then defaults that are real values, never placeholders.
  for name in "${SETTINGS[@]}"; do printf -v "$name" '%s' "${!name:-}"; done
  CONFIG=${CONFIG:-configs/prolip_b16_datacomp.py}
  # The source follows the shards' names unless set: *.array_record -> array_record, else tar.
  if [[ -z $DATA_SOURCE ]]; then
    if [[ $DATA_PATH == *.array_record ]]; then DATA_SOURCE=array_record; else DATA_SOURCE=tar; fi
  fi
}

# Refuse in one line naming them all: each NAME whose setting is empty, then each NOTE as written.
# Usage: require_settings NAME... [-- NOTE...]
require_settings() {
  local missing=() list
  while (($#)); do
    if [[ $1 == -- ]]; then shift; missing+=("$@"); break; fi
    [[ -n ${!1} ]] || missing+=("$1")
    shift
  done
  if ((${#missing[@]})); then
    list=$(printf '%s, ' "${missing[@]}")
    die "missing settings: ${list%, } (set them as environment variables or --name=value flags; see --help)"
  fi
}
