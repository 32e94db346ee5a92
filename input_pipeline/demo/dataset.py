"""The demo dataset: generated once into a cache folder as ArrayRecord, read by the real pipeline.

    ds = get_demo()                       # generates on first use (~30 s on 2 cores), then loads
    ds.split_path("train")                # ArrayRecord file for data.source="array_record"
    tok = ds.tokenizer()                  # word-level; pad = eos = 1, mask_id = 2, no downloads
    ds.zeroshot_tasks["object"]           # {"classnames": [...36], "templates": [...], ...}
    ev = ds.load_split("retrieval", image_size=32)   # eval-transformed arrays in memory

Splits (disjoint seeds; all images drawn independently from the same factor space):
    train      captions = the four levels (x level_weights); the pipeline draws one per epoch
    zeroshot   class-balanced over colour x shape ("red circle", 36 classes); label = class
    retrieval  one image per distinct (shape, colour, size, position) with its level-3 caption,
               so every caption has exactly one matching image (R@K is well defined)
    levels     every image with all four captions, for the uncertainty-vs-specificity analysis

Atomic cache: everything is written into a temporary sibling folder that is renamed into place
when complete, so a killed generation never leaves a folder that looks finished, and two
processes generating at once (several hosts on a shared disk) both end with the same result.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from input_pipeline import records, transforms
from prolip_jax.core.normalization import normalize
from input_pipeline.decode import load_rgb
from input_pipeline.demo import render

DEMO_VERSION = 1
SPLITS = ("train", "zeroshot", "retrieval", "levels")
_SPLIT_TAGS = {"train": 11, "zeroshot": 12, "retrieval": 13, "levels": 14}
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
PAD_ID = EOS_ID = 1   # the reference convention (SigLIP vocab: pad = eos = 1)
MASK_ID = 2
SPECIAL_TOKENS = ("<unk>", "</s>", "[MASK]")
OBJECT_TEMPLATES = ("a {}", "a small {}", "a medium {}", "a large {}")
SHAPE_TEMPLATES = ("a {}",)
_CHUNK = 1000


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    image_size: int = 64            # stored size; the pipeline resizes to data.image_size
    num_train: int = 50_000
    num_zeroshot: int = 1_080       # 30 per colour x shape class
    num_retrieval: int = 500        # at most 6*6*3*9 = 972 distinct level-3 captions
    num_levels: int = 500
    seed: int = 0
    level_weights: tuple[int, int, int, int] = (1, 1, 1, 1)   # train caption multiplicities
    context_length: int = 16

    def __post_init__(self):
        combos = len(render.SHAPES) * len(render.COLOURS) * len(render.SIZES) * 9
        if not 0 < self.num_retrieval <= combos:
            raise ValueError(f"num_retrieval must be in [1, {combos}] (distinct captions).")
        if len(self.level_weights) != 4 or min(self.level_weights) < 0 or not any(
                self.level_weights):
            raise ValueError(f"level_weights needs 4 non-negative ints, got {self.level_weights}.")
        if self.image_size < 16:
            raise ValueError("image_size must be >= 16 for the shapes to be recognisable.")

    def digest(self) -> str:
        blob = json.dumps({"version": DEMO_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> str:
    return os.environ.get("PROLIP_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "prolip_jax")


def object_classnames() -> list[str]:
    return [f"{c} {s}" for c in render.COLOUR_NAMES for s in render.SHAPES]


def _split_size(config: DemoConfig, split: str) -> int:
    return getattr(config, f"num_{split}")


def _factors(config: DemoConfig, split: str, index: int, retrieval_combos: np.ndarray | None
             ) -> render.Factors:
    rng = np.random.default_rng((config.seed, _SPLIT_TAGS[split], 0, index))
    if split == "zeroshot":
        c = index % (len(render.COLOURS) * len(render.SHAPES))
        colour, shape = divmod(c, len(render.SHAPES))
        return render.Factors(shape, colour, int(rng.integers(len(render.SIZES))),
                              int(rng.integers(9)))
    if split == "retrieval":
        combo = int(retrieval_combos[index])
        combo, position = divmod(combo, 9)
        combo, size = divmod(combo, len(render.SIZES))
        colour, shape = divmod(combo, len(render.SHAPES))
        return render.Factors(shape, colour, size, position)
    return render.random_factors(rng)


def _retrieval_combos(config: DemoConfig) -> np.ndarray:
    n = len(render.SHAPES) * len(render.COLOURS) * len(render.SIZES) * 9
    rng = np.random.default_rng((config.seed, _SPLIT_TAGS["retrieval"], 1))
    return rng.permutation(n)[:config.num_retrieval]


def _make_records(config: DemoConfig, split: str, start: int, stop: int) -> list[bytes]:
    """Encoded records [start, stop) of a split (runs in a worker process)."""
    combos = _retrieval_combos(config) if split == "retrieval" else None
    out = []
    for i in range(start, stop):
        f = _factors(config, split, i, combos)
        image = render.render(f, np.random.default_rng((config.seed, _SPLIT_TAGS[split], 1, i)),
                              config.image_size)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "PNG", compress_level=1)
        levels = f.captions()
        meta: dict[str, Any] = f.meta()
        if split == "train":
            txt: Any = [c for c, w in zip(levels, config.level_weights) for _ in range(w)]
        elif split == "zeroshot":
            txt = levels[2]
            meta["label"] = f.colour * len(render.SHAPES) + f.shape
        elif split == "retrieval":
            txt = levels[3]
        else:
            txt = list(levels)
        out.append(records.encode_record(buf.getvalue(), txt, f"{split}/{i:06d}", meta))
    return out


def _vocab() -> list[str]:
    words = {"a", "shape"}
    words.update(render.SHAPES, render.COLOUR_NAMES, render.SIZE_NAMES)
    for phrase in render.POSITION_NAMES + OBJECT_TEMPLATES + SHAPE_TEMPLATES:
        words.update(w for w in phrase.replace("{}", " ").split())
    return list(SPECIAL_TOKENS) + sorted(words)


def write_tokenizer(path: str, context_length: int) -> None:
    """A word-level `tokenizers` model over the demo's closed vocabulary -> tokenizer.json.

    Lower-cases, drops punctuation, appends </s> (id 1), pads with id 1 (pad = eos, as the
    reference), truncates keeping the </s>. Loadable by input_pipeline.tokenizers ("hf") too.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[^a-z0-9\s]"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", EOS_ID)])
    tok.enable_truncation(max_length=context_length)
    tok.enable_padding(length=context_length, pad_id=PAD_ID, pad_token="</s>")
    tok.save(path)


class DemoTokenizer:
    """texts -> int32 [N, context_length]; pad_id = eos_id = 1, mask_id = 2 (never emitted)."""

    def __init__(self, path: str, context_length: int):
        from tokenizers import Tokenizer
        self.path, self.context_length = path, context_length
        self._tok = Tokenizer.from_file(path)
        self._tok.enable_truncation(max_length=context_length)
        self._tok.enable_padding(length=context_length, pad_id=PAD_ID, pad_token="</s>")
        self.vocab_size = self._tok.get_vocab_size()
        self.pad_id, self.eos_id, self.mask_id = PAD_ID, EOS_ID, MASK_ID

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        return np.asarray([e.ids for e in self._tok.encode_batch(list(texts))], np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i not in (PAD_ID, MASK_ID)])


@dataclasses.dataclass
class DemoDataset:
    """A generated demo cache folder."""
    root: Path
    config: DemoConfig
    meta: dict[str, Any]

    def split_path(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(f"Unknown demo split {split!r}; splits: {SPLITS}.")
        return str(self.root / f"{split}.array_record")

    def tokenizer(self, context_length: int | None = None) -> DemoTokenizer:
        return DemoTokenizer(str(self.root / TOKENIZER_FILE),
                             context_length or self.config.context_length)

    @property
    def zeroshot_tasks(self) -> dict[str, dict[str, Any]]:
        return self.meta["zeroshot_tasks"]

    def load_split(self, split: str, image_size: int | None = None,
                   normalization: str = "openai", image_dtype: str = "float32",
                   context_length: int | None = None) -> dict[str, Any]:
        """A whole eval split in memory, through the pipeline's eval transform.

        Returns "image" [N, S, S, 3] (float32 normalised, or uint8), "captions" (str array,
        [N] or [N, 4] for "levels"), "text" int32 tokens ([N, L] or [N, 4, L]), the factor
        indices "shape", "colour", "size", "position" [N], and "label" [N] for "zeroshot".
        """
        import grain
        size = image_size or self.config.image_size
        src = grain.sources.ArrayRecordDataSource([self.split_path(split)])
        images, captions, factors = [], [], {k: [] for k in ("shape", "colour", "size",
                                                               "position")}
        labels = []
        for i in range(len(src)):
            rec = records.decode_record(src[i])
            img = load_rgb(rec["image"], max_pixels=1 << 30, min_side=1)
            images.append(transforms.eval_transform(img, size))
            captions.append(rec["txt"])
            for k in factors:
                factors[k].append(rec["meta"][k])
            if "label" in rec["meta"]:
                labels.append(rec["meta"]["label"])
        image = np.stack(images)
        tok = self.tokenizer(context_length)
        caps = np.asarray(captions)
        out = {"image": (normalize(image, normalization)
                         if image_dtype == "float32" else image),
               "captions": caps,
               "text": tok(caps.reshape(-1).tolist()).reshape(*caps.shape, -1)}
        out.update({k: np.asarray(v, np.int32) for k, v in factors.items()})
        if labels:
            out["label"] = np.asarray(labels, np.int32)
        return out


def _meta(config: DemoConfig) -> dict[str, Any]:
    return {
        "version": DEMO_VERSION, "config": dataclasses.asdict(config),
        "splits": {s: {"file": f"{s}.array_record", "num_records": _split_size(config, s)}
                   for s in SPLITS},
        "zeroshot_tasks": {
            "object": {"classnames": object_classnames(), "templates": list(OBJECT_TEMPLATES),
                       "label_key": "label"},
            "shape": {"classnames": list(render.SHAPES), "templates": list(SHAPE_TEMPLATES),
                      "label_key": "shape"}},
        "caption_levels": list(render.LEVEL_NAMES),
        "factors": {"shape": list(render.SHAPES), "colour": list(render.COLOUR_NAMES),
                    "size": list(render.SIZE_NAMES), "position": list(render.POSITION_NAMES)},
        "tokenizer": {"file": TOKENIZER_FILE, "pad_id": PAD_ID, "eos_id": EOS_ID,
                      "mask_id": MASK_ID, "vocab": _vocab()},
    }


def generate(config: DemoConfig, directory: str, num_workers: int = 0) -> None:
    """Writes the splits, tokenizer and meta.json into `directory` (not atomic by itself)."""
    from array_record.python.array_record_module import ArrayRecordWriter
    os.makedirs(directory, exist_ok=True)
    jobs = [(s, a, min(a + _CHUNK, _split_size(config, s))) for s in SPLITS
            for a in range(0, _split_size(config, s), _CHUNK)]
    writers = {s: ArrayRecordWriter(os.path.join(directory, f"{s}.array_record"),
                                    "group_size:1") for s in SPLITS}
    try:
        if num_workers > 0:
            ctx = multiprocessing.get_context("spawn")   # never fork a process running JAX
            with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=ctx) as pool:
                results = pool.map(_make_records, *zip(*[(config, *j) for j in jobs]))
                for (split, _, _), recs in zip(jobs, results):
                    for r in recs:
                        writers[split].write(r)
        else:
            for split, a, b in jobs:
                for r in _make_records(config, split, a, b):
                    writers[split].write(r)
    finally:
        for w in writers.values():
            w.close()
    write_tokenizer(os.path.join(directory, TOKENIZER_FILE), config.context_length)
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(_meta(config), f, indent=1)


def get_demo(cache_dir: str | None = None, num_workers: int | None = None,
             **config_kwargs: Any) -> DemoDataset:
    """The demo dataset for these DemoConfig fields, generated into the cache if missing.

    num_workers: generation processes; default: all cores for big configs, 0 for tiny ones.
    """
    if "level_weights" in config_kwargs:
        config_kwargs["level_weights"] = tuple(config_kwargs["level_weights"])
    config = DemoConfig(**config_kwargs)
    root = Path(cache_dir or default_cache_dir()) / f"demo-v{DEMO_VERSION}-{config.digest()}"
    if not (root / META_FILE).exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.parent / f".tmp-{root.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        total = sum(_split_size(config, s) for s in SPLITS)
        if num_workers is None:
            num_workers = min(os.cpu_count() or 1, 8) if total > 5 * _CHUNK else 0
        try:
            generate(config, str(tmp), num_workers)
            try:
                os.rename(tmp, root)
            except OSError:
                if not (root / META_FILE).exists():   # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(root / META_FILE) as f:
        meta = json.load(f)
    if meta.get("version") != DEMO_VERSION:
        raise ValueError(f"{root} was written by demo version {meta.get('version')}, "
                         f"not {DEMO_VERSION}; delete it to regenerate.")
    return DemoDataset(root, config, meta)
