"""The run's checkpoints, and how a run stops for a fault: save what is sound, then one line.

`Checkpoints` saves asynchronously (orbax), checks a state not known to be finite before its
first save, and turns a failed save (a full disk, a lost mount) into a `RunFault` naming the
folder, the bytes needed and free, and the newest intact checkpoint. `Checkpoints.outside_the_model`
is the one mechanism for the parts around the model (the data pipeline, an evaluator, the metrics
writer): their failure leaves the model state sound, so it is saved first and the run stops in
one line naming both.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import jax
import orbax.checkpoint as ocp

from input_pipeline.tar_source import NoRecordsError
from prolip_jax.core import checkpoint as ckpt_lib
from prolip_jax.core import optim, step as step_lib
from prolip_jax.runtime import paths
from prolip_jax.trainer.data import DataStalled
from prolip_jax.trainer import config as config_lib
from prolip_jax.trainer.state import Run, to_host


class RunFault(RuntimeError):
    """A fault the run stopped for after keeping what it could (a failed save, a failure outside
    the model); its message is the one line the user sees."""


def manager(workdir: Path, keep: int) -> ocp.CheckpointManager:
    """The asynchronous checkpoint manager of `workdir`/checkpoints, keeping the newest `keep`."""
    return ocp.CheckpointManager(
        paths.absolute(workdir / "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True),
        item_names=ckpt_lib.TRAIN_ITEMS)


class Checkpoints:
    """Saves of `run`'s state into `mngr`. `known_finite`: whether the state is known finite (a
    random init is; the step keeps only finite updates, so it stays so)."""

    def __init__(self, run: Run, mngr: ocp.CheckpointManager, known_finite: bool):
        self.run, self.mngr, self.known_finite = run, mngr, known_finite
        self.directory = Path(mngr.directory)
        self.record = config_lib.record(run.tc)  # what each checkpoint keeps of the config
        self.saving: int | None = None  # the step of the last save started
        replicated = jax.sharding.NamedSharding(run.parts.mesh, jax.sharding.PartitionSpec())
        # A warm-started or restored state (an imported NaN, a checkpoint from other code) is
        # checked once, at its first save: a reduction per leaf, compiled only when needed.
        self._is_finite = jax.jit(lambda s: step_lib.all_finite((s.params, s.opt_state)), out_shardings=replicated)

    def save(self, step: int, force: bool = False, data_state: ckpt_lib.StateSnapshot | None = None) -> None:
        run = self.run
        if not self.known_finite:
            if not bool(to_host(self._is_finite(run.state))):
                raise FloatingPointError(f"the train state at step {step} is not finite; not saving it. "
                                         f"{self.last_good()}")
            self.known_finite = True
        try:
            ckpt_lib.save_train_state(self.mngr, step, run.state, run.parts.model_config, self.record,
                                      run.parts.data.batches, force=force, data_state=data_state,
                                      locked=optim.locked_paths(run.parts.traced.shapes, run.tc.optim, step),
                                      tokenizer=run.parts.data.tokenizer_file)
        except Exception as e:  # noqa: BLE001 - a failed save (orbax re-raises the previous one's here)
            raise self.failed(e, step) from None
        self.saving = step

    def save_unless_saved(self, step: int, data_state: ckpt_lib.StateSnapshot | None = None) -> None:
        """Saves `step` now unless it is the newest checkpoint already, then waits for every save."""
        if self.mngr.latest_step() != step:
            self.save(step, force=True, data_state=data_state)
        self.finish()

    def finish(self) -> None:
        """Waits for the asynchronous saves; one that failed stops the run in one line."""
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self.failed(e, self.run.step) from None

    def failed(self, e: BaseException, at: int) -> RunFault:
        """A failed save: the partial folder removed, one line naming the folder, the bytes
        needed and free, and the newest intact checkpoint."""
        # Orbax reports a background save's failure at the next save: the one still unfinished failed.
        unfinished = self.saving is not None and not (self.directory / str(self.saving)).exists()
        failed = ckpt_lib.failed_step(e, self.saving if unfinished else at)
        logging.getLogger("absl").error("saving checkpoint step %d failed", failed, exc_info=e)  # train.log
        ckpt_lib.wait_for_failed_save(self.mngr)  # nothing may still write into the folders removed below
        if self.run.is_chief:
            ckpt_lib.remove_partial_saves(self.directory)
        state = self.run.state
        state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
        return RunFault(ckpt_lib.save_failure(self.directory, failed, e, state_bytes))

    def last_good(self) -> str:
        good = self.mngr.latest_step()
        if good is None:
            return "No checkpoint was written."
        return f"The last good checkpoint is step {good} in {self.run.workdir / 'checkpoints'}."

    @contextlib.contextmanager
    def outside_the_model(self, what: str) -> Iterator[None]:
        """A failure of `what` (the data pipeline, an evaluator, the metrics writer) leaves the
        model state sound: it is saved first, then the run stops in one line naming both."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure of these parts ends the same way
            raise self.stopped_by(what, e) from None

    def stopped_by(self, what: str, e: BaseException) -> BaseException:
        if isinstance(e, (RunFault, FloatingPointError)):
            return e
        step = self.run.step
        logging.getLogger("absl").error("%s failed after step %d", what, step, exc_info=e)  # train.log
        if step == 0:
            return RunFault(f"{what} failed before the first step ({gist(e, self.run)}); no checkpoint was written")
        self.save_unless_saved(step, data_state=self.run.data_state)  # the data position before the failed read
        return RunFault(f"{what} failed after step {step} ({gist(e, self.run)}); saved checkpoint step {step} "
                        f"({self.directory / str(step)}): rerun the same command to resume from it")

    def close(self) -> None:
        for close in (self.mngr.wait_until_finished, self.mngr.close):  # after a failed save: its error again
            try:
                close()
            except Exception:  # noqa: BLE001 - already reported in one line; the details in train.log
                logging.getLogger("absl").exception("closing the checkpoint manager")


def gist(e: BaseException, run: Run) -> str:
    """The failure `e` in a few words for the one line."""
    if isinstance(e, StopIteration):
        return (f"its data ended (data.num_epochs={run.tc.data.num_epochs}): raise "
                "--config.data.num_epochs or lower --config.total_steps")
    if isinstance(e, (NoRecordsError, DataStalled, paths.BucketError)):  # written for the user: shown whole
        return " ".join(str(e).split())
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
