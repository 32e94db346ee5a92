"""What every data source implements: `DataSource` (defaults included) and the `Records` it reads.

A source answers, for its name in `data.source`: which config fields it needs
(`check`), the records the pipeline reads for training and evaluation (`read`), what besides
its files pins those records in the resume fingerprint (`spec`), how the trainer fills its
config from the model (`for_model`), and which configs/eval/ file evaluates a run on it
(`evaluate_with`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from input_pipeline.captions import CAPTION_SOURCES

# What data.path holds for the sources that read shards (messages only).
SHARDS_HINT = "files, globs or a brace pattern such as 'shards/{00000..00009}.tar'"


@dataclasses.dataclass
class Records:
    """A source's records, in one of two shapes.

    Random access: `items` (len() and [i]) and `to_raw`, which turns (epoch, i, items[i]) into
    a raw record (records.py) or a Skip, in the reading threads or worker processes (so it is
    picklable and does the I/O). The pipeline orders them (epoch_order.EpochOrderDataset): exact
    resumption on any host and worker layout.
    Streaming: `stream`, a grain IterDataset of raw records in the source's own order, with the
    resume interface of EpochOrderDataset (origin, initial_origin, restore_origin, resplit);
    tar_source.TarStreamDataset is one.
    `files` (paths, or a dataset name) and `settings` (the source's options that choose among
    their records, as JSON strings) pin the records: digested into the iterator state's
    fingerprint. `relocatable`: the files are paths, and the same files read from another
    directory or bucket are the same records (a resume then matches them by name).
    """
    files: Sequence[str]
    items: Any = None
    to_raw: Callable[[Any], Any] | None = None
    stream: Any = None
    settings: Sequence[str] = ()
    relocatable: bool = True


class DataSource:
    """One `data.source`. Subclasses set `name` and override what differs from these defaults.

    `cfg` below is an input_pipeline.config.DataConfig (not imported: the config imports this
    package).
    """
    name: str = ""
    # What data.path holds; "" for the sources that read no data.path (the config refuses an
    # empty data.path for the others).
    path_hint: str = ""
    # True: the source draws whole batches itself (`batches`) and has no records.
    draws_batches: bool = False
    # True: the source brings its own tokenizer (`tokenizer`); data.tokenizer is not used.
    own_tokenizer: bool = False

    def resolve(self, cfg: Any) -> str:
        """The name of the source that reads `cfg` ("auto" picks one by data.path)."""
        return self.name

    def check(self, cfg: Any) -> None:
        """ValueError, one line naming the field, for what this source needs and refuses."""
        if self.path_hint and not cfg.path:
            raise ValueError(f"data.source={self.name!r} needs data.path ({self.path_hint}).")
        if cfg.splits or cfg.noise_ratio or cfg.positive_level != "image":
            raise ValueError(f"data.splits, data.noise_ratio and data.positive_level apply "
                             f"to the caption sources {CAPTION_SOURCES}, not "
                             f"data.source={self.name!r}.")

    def read(self, cfg: Any, *, shuffle: bool, num_epochs: int | None, process_index: int,
             process_count: int) -> Records:
        """The records of `cfg` (training and evaluation alike; the order arguments matter to
        streaming sources only: random-access ones are ordered by the pipeline)."""
        raise NotImplementedError(f"data.source={self.name!r} has no records to read")

    def spec(self, cfg: Any) -> dict[str, Any]:
        """The source's part of the iterator state's fingerprint besides its files (its keys
        are in every fingerprint: a saved state is compared key by key)."""
        return {"shuffle_buffer_size": None}

    def tokenizer(self, cfg: Any) -> Any:
        """The source's own tokenizer (when `own_tokenizer`)."""
        raise NotImplementedError(f"data.source={self.name!r} has no tokenizer of its own")

    def for_model(self, cfg: Any, context_length: int) -> Any:
        """`cfg` with what the model decides (the text context length), for the trainer."""
        if not cfg.tokenizer:
            return cfg
        return cfg.replace(tokenizer={"context_length": context_length, **cfg.tokenizer})

    def batches(self, global_batch: int, image_size: int, context_length: int, vocab_size: int,
                seed: int) -> Any:
        """This host's batch iterator (when `draws_batches`)."""
        raise NotImplementedError(f"data.source={self.name!r} draws no batches itself")

    def evaluate_with(self, cfg: Any) -> tuple[str, str]:
        """(configs/eval/ file, its flags) that evaluate a run trained on this source: by
        default zero-shot on an ImageFolder the user names."""
        return "imagefolder.py", " --config.root=YOUR_IMAGEFOLDER"
