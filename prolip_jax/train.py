r"""The trainer's command line (the trainer itself is the package prolip_jax/trainer/).

    python -m prolip_jax.train --config configs/tiny.py --workdir /tmp/prolip_tiny [--config.x=y ...]

Runs on CPU (1..N devices), GPU and TPU. Multi-host: `jax.distributed.initialize()` is called
on TPU pods and under SLURM (auto-detected), or with explicit `--coordinator_address`,
`--num_processes`, `--process_id`. A workdir holding a checkpoint resumes by itself (params,
optimiser, step and the data iterator's position); SIGTERM saves a checkpoint and exits cleanly.
"""
from __future__ import annotations

# The imports below wait until `--help` is answered and, in a multi-process launch, until this
# process has become the supervisor of the one that trains: jax and the project take seconds to load.
import sys

from prolip_jax.runtime import supervise, train_flags, xla_flags

if __name__ == "__main__":
    train_flags.exit_if_help(sys.argv, __doc__)
    train_flags.exit_if_supervisor(sys.argv)
    xla_flags.apply()  # the platform's XLA flags, before jax's backend starts (the user's XLA_FLAGS win)

import os
from typing import Any, NoReturn

import jax

from prolip_jax.runtime import config_args, paths, peers
from prolip_jax.trainer.data import BatchFetcher
from prolip_jax.trainer.checkpoints import RunFault
from prolip_jax.trainer.config import with_defaults
from prolip_jax.trainer.loop import train


def maybe_initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                                 process_id: int | None) -> None:
    """Explicit flags win; otherwise SLURM jobs of more than one task, TPU pod slices, or
    PROLIP_DISTRIBUTED=1 (what scripts/launch_tpu_pod.sh sets) call the auto-detecting
    `jax.distributed.initialize()`."""
    if coordinator_address:
        # CPU processes need gloo for cross-process collectives (no effect on GPU/TPU clients).
        # Nothing may touch the backend before initialize(), so do not ask which one it is.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif supervise.auto_distributed():
        jax.distributed.initialize()


def _split_config_arg(argv: list[str]) -> tuple[str, list[str]]:
    """(the value of --config, the other arguments)."""
    rest, spec = [argv[0]], None
    args = iter(argv[1:])
    for a in args:
        if a == "--config":
            spec = next(args, None)
        elif a.startswith("--config="):
            spec = a.split("=", 1)[1]
        else:
            rest.append(a)
    if not spec:
        raise ValueError("--config is required: --config configs/<name>.py[:args]")
    return spec, rest


def parse_command_line(argv: list[str]) -> tuple[Any, Any]:
    """(config, flag values) of `argv` = [program, --config FILE[:args], --workdir DIR,
    --config.<field>=value ...]. Raises ValueError, FileNotFoundError or absl's flags.Error
    whose first line names the problem."""
    from absl import flags
    from ml_collections import config_flags

    spec, argv = _split_config_arg(argv)
    config = with_defaults(config_args.load_config_file(spec))
    config_args.check_overrides(config, argv)
    fv = flags.FlagValues()  # not absl's global FLAGS: parsing twice in one process is fine
    holder = config_flags.DEFINE_config_dict("config", config, lock_config=True, flag_values=fv, sys_argv=argv)
    define = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer}
    for name, kind, _, text in train_flags.FLAGS:  # declared once, beside the help (train_flags.py)
        define[kind](name, None, text, flag_values=fv, required=name == "workdir")
    fv(argv)
    return holder.value, fv


def main(argv: list[str] | None = None) -> None:
    """The command line. A bad command prints one line naming the problem and exits 2, before
    anything is created; `--config.<field>=value` overrides any field of the config."""
    from absl import flags, logging

    argv = list(sys.argv if argv is None else argv)
    if any(a in train_flags.HELP_ARGS for a in argv[1:]):
        print(train_flags.help_text(argv, __doc__))
        return

    def fail(e: BaseException) -> None:
        msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        print("error: " + " ".join(msg.split()), file=sys.stderr)  # one line
        sys.exit(2)

    try:
        config, fv = parse_command_line(argv)
    except (flags.Error, ValueError, TypeError, FileNotFoundError, AttributeError, KeyError) as e:
        fail(e)

    if supervise.is_child():
        supervise.die_with_parent()
    elif fv.coordinator_address or supervise.auto_distributed():  # several processes: prolip_jax/runtime/supervise.py
        sys.exit(supervise.run_trainer(argv, fv.workdir, fv.process_id, fv.num_processes))
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
    maybe_initialize_distributed(fv.coordinator_address, fv.num_processes, fv.process_id)
    watch = peers.watch(fv.workdir)  # several processes: a lost one ends the others in one line
    code = 2
    try:
        train(config, fv.workdir, stop_at_step=fv.stop_at_step)
        code = 0
    except (ValueError, FileNotFoundError, FloatingPointError, RunFault, paths.BucketError) as e:
        fail(e)
    except KeyboardInterrupt:  # Ctrl-C: stop now; the checkpoints written so far stay
        print(f"interrupted (Ctrl-C): rerun the same command to resume from the newest checkpoint in "
              f"{fv.workdir}", file=sys.stderr)
        code = 130
        sys.exit(code)
    finally:
        if watch is not None:
            watch.stop(code)


def run_command(argv: list[str] | None = None) -> NoReturn:
    """`python -m prolip_jax.train`: `main`, then the exit. After a hung read was abandoned
    (trainer.data.BatchFetcher) its library threads may never end, so the process ends without
    waiting for them."""
    code = 1
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        if BatchFetcher.abandoned:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run_command()
