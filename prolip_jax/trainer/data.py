"""The trainer's view of the data: `build_train_data(tc, model_config, step_config)` gives a
`TrainData`: this host's batches (the grain pipeline of `input_pipeline` for the registered
source `data.source` names, input_pipeline/sources/: tar, ArrayRecord, tfds, demo, caption
datasets, CSV/Parquet listings; or, for a source that draws whole batches itself,
`data.source = "random"`, its batches), the tokenizer file the checkpoints record, and the
caption index of a caption source.

Before anything compiles, the tokenizer is checked against the model (`check_tokenizer`) and
the masking ids against the tokenizer (`check_masking`). `BatchFetcher` reads the batches in a
thread, so that the trainer answers signals while a read waits and stops one that hangs.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable


from input_pipeline import mixture
from input_pipeline.config import DataConfig
from input_pipeline.shards import split_patterns
from input_pipeline.pipeline import build_train_iterator, resolve_tokenizer
from input_pipeline.sources import DataSource, demo as demo_source
from input_pipeline.tokenizer_files import TokenizerFile
from prolip_jax.core.targets import BY_IMAGE_ID
from prolip_jax.runtime import paths


class DataStalled(RuntimeError):
    """No batch came within the trainer's `data_timeout_s`."""


class BatchFetcher:
    """`next(iterator)` in a daemon thread, so that the trainer's main thread keeps answering
    SIGTERM and Ctrl-C while a read is slow, and stops a read that hangs (a stuck mount, a
    worker that never answers) after `timeout_s` instead of waiting forever."""

    POLL_S = 0.2
    abandoned = False  # a fetcher closed with a read in flight: its threads may never end

    def __init__(self, iterator: Any, timeout_s: float):
        self.iterator, self.timeout_s = iterator, timeout_s
        self.in_flight = False  # a read started and not yet returned (its thread may hang)
        self._requests: queue.Queue[bool] = queue.Queue()  # True: read one batch; False: end the thread
        self._results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _serve(self) -> None:
        while self._requests.get():
            try:
                self._results.put((True, next(self.iterator)))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
                self._results.put((False, e))

    def next(self, stop: Callable[[], bool] = lambda: False) -> Any:
        """The next batch; None when `stop()` turns true while waiting. Raises what the iterator
        raised (StopIteration included), or DataStalled after `timeout_s` without a batch."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="batch-fetcher", daemon=True)
            self._thread.start()
        if not self.in_flight:
            self._requests.put(True)
            self.in_flight = True
        start = time.monotonic()
        while True:
            try:
                ok, value = self._results.get(timeout=self.POLL_S)
            except queue.Empty:
                if stop():
                    return None
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    raise DataStalled(f"no batch came in {waited:.0f} s (a stuck read, mount or data worker; "
                                      "the limit is --config.data_timeout_s)") from None
                continue
            self.in_flight = False
            if ok:
                return value
            raise value

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes the iterator in a thread given `timeout_s`: a read that hangs (in flight, or
        begun by the pipeline's own threads) can keep a close waiting forever. A close that does
        not finish, or that runs beside a read in flight, is abandoned (`abandoned`: the command
        then ends without waiting for those threads); its failure goes to the log. A clean close
        that fails raises here."""
        if self._thread is not None and not self.in_flight:
            self._requests.put(False)
            self._thread.join()
        failed: list[BaseException] = []

        def close() -> None:
            try:
                self.iterator.close()
            except Exception as e:  # noqa: BLE001 - raised below, or logged beside a hung read
                failed.append(e)

        closing = threading.Thread(target=close, name="batch-fetcher-close", daemon=True)
        closing.start()
        closing.join(timeout_s)
        if self.in_flight or closing.is_alive():
            BatchFetcher.abandoned = True
            for e in failed:  # the workers of a hung read may never have started
                logging.getLogger(__name__).warning("closing the data pipeline", exc_info=e)
            if closing.is_alive():
                logging.getLogger(__name__).warning("closing the data pipeline took over %.0f s; "
                                                    "left to end with the process", timeout_s)
        elif failed:
            raise failed[0]


@dataclasses.dataclass
class TrainData:
    """A run's data: this host's batches (an iterator with the input pipeline's interface: next,
    get_state/set_state, stats, close), the tokenizer file the checkpoints record (the model
    travels with it), and the caption index of a caption source (which pairs data.noise_ratio
    corrupted; input_pipeline/captions.py)."""

    batches: Any
    tokenizer_file: TokenizerFile | None = None
    caption_index: Any = None


def build_train_data(tc: Any, model_config: Any, scfg: Any) -> TrainData:
    """The data of `tc` (prolip_jax.trainer.config.TrainConfig; see configs/), with the step's
    masking settings `scfg` (prolip_jax.core.step.StepConfig)."""
    d = tc.data
    if d.mixture:
        return _build_mixture(tc, model_config, scfg)
    source = d.data_source()
    if source.draws_batches:
        return TrainData(source.batches(d.batch_size, d.image_size, model_config.text.context_length,
                                        model_config.text.vocab_size, seed=tc.run.seed))
    _check_readable(d, "data")
    d = source.for_model(d, model_config.text.context_length)
    tokenizer = _tokenizer(d, tc, model_config, scfg)
    it = build_train_iterator(d, tokenizer)
    return TrainData(it, TokenizerFile.of(tokenizer, tc.masking), it.caption_index)


def _check_readable(d: DataConfig, where: str) -> None:
    """What the source of `d` needs (before a bucket is probed), that its bucket answers, and a
    tokenizer file for it: one line naming the field `where`.<field>."""
    d.check_source()
    for pattern in split_patterns(d.path):  # a bucket: one line on what is wrong
        paths.check_reachable(pattern, f"{where}.path", f"--config.{where}.path" if where == "data" else f"{where}.path")
    if d.tokenizer and not d.tokenizer.get("path") and not d.data_source().own_tokenizer:
        raise ValueError(f"data.source={d.source!r} needs data.tokenizer.path (a tokenizer file; "
                         "see input_pipeline/tokenizers.py for the kinds and where files come from)")


def _tokenizer(d: DataConfig, tc: Any, model_config: Any, scfg: Any) -> Any:
    """The tokenizer of `d`, checked against the model and the masking settings."""
    tokenizer = resolve_tokenizer(d, None)
    check_tokenizer(tokenizer, model_config)
    if scfg.masks_text:
        check_masking(tokenizer, tc.masking, model_config.text.vocab_size)
    return tokenizer


def _build_mixture(tc: Any, model_config: Any, scfg: Any) -> TrainData:
    """A data.mixture run's data (input_pipeline/mixture.py): every source checked as one
    source's is, one tokenizer (data.tokenizer) for all."""
    if scfg.targets.positives in BY_IMAGE_ID:
        raise ValueError(f"targets.positives={scfg.targets.positives!r} reads the batches' image ids, which a "
                         "data.mixture does not give (each dataset numbers its own images): use "
                         "--config.targets.positives=diagonal or one data.source")
    d = tc.data
    parts = mixture.parts(d)
    for part in parts:
        source = part.config.data_source()
        if source.draws_batches or source.own_tokenizer:
            raise ValueError(f"{part.where}: data.source={part.config.source!r} cannot be mixed (it "
                             f"{'draws its own batches' if source.draws_batches else 'brings its own tokenizer'}); "
                             "mix sources of records read with data.tokenizer")
        _check_readable(part.config, part.where)
    tokenizer = _tokenizer(DataSource().for_model(d, model_config.text.context_length), tc, model_config, scfg)
    return TrainData(mixture.build_mixture_iterator(d, tokenizer), TokenizerFile.of(tokenizer, tc.masking))


def check_tokenizer(tokenizer: Any, model_config) -> None:
    """Token ids past the embedding table would gather garbage on device (and NaN every step):
    refuse a tokenizer whose vocabulary or context does not fit the text tower."""
    t = model_config.text
    if tokenizer.vocab_size > t.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's text embedding has "
                         f"{t.vocab_size} rows (model.text vocab_size); use a matching tokenizer or model")
    if tokenizer.context_length > t.context_length:
        raise ValueError(f"the tokenizer's context_length {tokenizer.context_length} exceeds the model's "
                         f"{t.context_length}")


def _describe(tokenizer: Any, token_id: int) -> str:
    piece = tokenizer.id_to_piece(token_id)
    kind = tokenizer.token_kind(token_id)
    what = {"unknown": "the unknown-word id", "normal": "an ordinary piece text is encoded into",
            "byte": "a byte-fallback piece text is encoded into", "special": "a special token",
            "unused": "an unused piece", "outside": "outside the tokenizer's vocabulary"}[kind]
    return f"{piece!r} ({what})" if piece is not None else what


def _tokenizer_name(tokenizer: Any) -> str:
    path = getattr(tokenizer, "path", None)
    return f"the tokenizer {path}" if path else "the tokenizer"


def check_masking(tokenizer: Any, masking: Any, model_vocab_size: int | None = None) -> None:
    """`masking.mask_token_id` must be an id that no text encodes to (a special / reserved token
    such as the [MASK] piece scripts/train_tokenizer.py reserves, or an id past the tokenizer's
    vocabulary inside the model's embedding, as the reference's 32000); `<unk>` or a word piece
    would make [MASK] indistinguishable from real text. `masking.protected_ids` must hold the
    tokenizer's pad and EOS ids (never masked) and no ordinary piece. ValueError naming the id,
    what it is in the tokenizer, and the id to use. Tokenizers that cannot describe their ids
    (tests' stand-ins, the demo's) are not checked."""
    if not hasattr(tokenizer, "token_kind"):
        return
    mask = int(masking.mask_token_id)
    protected = tuple(int(i) for i in masking.protected_ids)
    pad, eos = tokenizer.pad_id, getattr(tokenizer, "eos_id", None)
    name = _tokenizer_name(tokenizer)
    # Ids free for [MASK]: reserved specials no text encodes to, else the first id past the
    # tokenizer's vocabulary if the model's embedding has rows there.
    free = {i: p for i, p in tokenizer.special_ids().items() if i not in protected}
    if not free and model_vocab_size is not None and tokenizer.vocab_size < model_vocab_size:
        free = {tokenizer.vocab_size: None}
    named = sorted(free, key=lambda i: ("mask" not in str(free[i]).lower(), i))
    suggest = (f"--config.masking.mask_token_id={named[0]}"
               + (f" ({free[named[0]]!r})" if free[named[0]] else " (an id the tokenizer never produces)")
               if named else "")
    kind = tokenizer.token_kind(mask)
    problem = None
    if mask in (pad, eos):
        problem = (f"masking.mask_token_id={mask} is the pad/EOS id of {name}: masked tokens would read "
                   f"as padding and be protected from masking")
    elif kind in ("unknown", "normal", "byte"):
        problem = (f"masking.mask_token_id={mask} is {_describe(tokenizer, mask)} in {name}: "
                   f"[MASK] must be a reserved token no text encodes to, or the model learns "
                   f"{'unknown words' if kind == 'unknown' else 'that piece'} and [MASK] as one token")
    if problem and kind == "normal" and not named:
        # No id to spare (e.g. the OpenAI CLIP BPE vocabulary fills the embedding exactly):
        # a rarely used piece is the only choice, as configs/prolip_b16_datacomp.py's H/14.
        logging.warning("%s; the tokenizer has no reserved id to use instead, so it is kept.", problem)
        problem = None
    if problem:
        raise ValueError(problem + (f". Use {suggest}." if suggest else
                                    ". Train a tokenizer with a reserved [MASK] piece (scripts/train_tokenizer.py)."))
    missing = [f"{what} id {i}" for what, i in (("pad", pad), ("EOS", eos))
               if i is not None and i not in protected]
    if missing:
        ids = tuple(sorted({i for i in (pad, eos) if i is not None} | set(protected)))
        raise ValueError(f"masking.protected_ids={protected} lacks the {' and '.join(dict.fromkeys(missing))} of "
                         f"{name}: padding / the end of every caption would be masked too. "
                         f"Use --config.masking.protected_ids='{ids}'")
    words = [i for i in protected if i not in (pad, eos) and tokenizer.token_kind(i) in ("unknown", "normal", "byte")]
    if words:
        raise ValueError(f"masking.protected_ids={protected} holds {', '.join(f'{i} = {_describe(tokenizer, i)}' for i in words)} "
                         f"in {name}: protected ids are the pad/EOS ids that are never masked, and a word "
                         f"there would never be masked. Use "
                         f"--config.masking.protected_ids='{tuple(i for i in protected if i not in words)}'")


def demo_kwargs(data: DataConfig, model_config) -> dict[str, Any]:
    """`input_pipeline.demo.get_demo` kwargs of a `data.source="demo"` run (the trainer's typed
    `config.data`) with the model's context length (part of the cache key), so whoever else opens
    the run's dataset (scripts/demo.py, its evaluation) finds the same cache folder."""
    return demo_source.run_kwargs(data, model_config.text.context_length)
