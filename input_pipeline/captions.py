"""Training sources with several captions per image: COCO and Flickr30K (Karpathy splits) and
CUB Captions, read straight from their usual files through the exact, resumable pipeline.

    data.source = "coco_karpathy"   caption_file = dataset_coco.json, image_root = COCO root
                                    (image_root/<filepath>/<filename>, e.g. train2014/...)
    data.source = "flickr30k"       caption_file = dataset_flickr30k.json, image_root = images
    data.source = "cub"             image_root = CUB root: images/<NNN.Class>/<img>.jpg and
                                    text_c10/<NNN.Class>/<img>.txt (Reed et al. 2016, as PCME
                                    reads them); class splits <split>classes.txt (one class
                                    folder per line) in data.class_split_dir (default the root)

The annotations are parsed once (every host, identically) into a `CaptionIndex`: the images
of the training split (data.splits; default train+restval = 113,287 COCO images, train for
Flickr30K, trainval = 150 CUB classes) and their (image, caption) pairs, in file order.

Iteration (data.caption_iteration):
  per_caption   one record per (image, caption) pair and epoch (VSE++/PCME style epochs);
  per_image     one record per image and epoch; its caption is drawn from the image's list by
                the decoder's generator, seeded by (seed, epoch, image) (decode.ExampleDecoder),
                so the draw changes every epoch and is the same in a resumed run.
Either way the source is random access under epoch_order.EpochOrderDataset: exact resumption and
host sharding come from there. Every record carries "image_id" (data.positive_level: the
dataset's image id, or for cub the class, DAA §5.1.1: all pairs of a class are
positives), batched as int32 for config.targets.positives="image_id".

Bad data: an annotation problem (missing split, an entry without captions, a CUB class without
its folder, a caption file without its image, an image without captions) is an error at
construction naming the file and the entry. Image files are only opened at read time: one
absent then is skipped and counted ("missing_image") like a missing image in any other source
(stat-ing 113k files up front costs minutes on network storage). At construction a sample of
up to 32 images is checked: if none exists the root is wrong, and that is an error.

Noisy correspondence (data.noise_ratio; PCME++ §3.2, following NCR, Huang et al.
2021): a seeded round(ratio * N) of the N pairs have their captions shuffled among themselves;
`write_noisy_pairs` records which (the trainer writes <workdir>/noisy_pairs.json).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from input_pipeline import caption_files
from input_pipeline.records import Skip
from prolip_jax.runtime import paths as fs

log = logging.getLogger(__name__)

# Split names per caption source. CUB: <split>classes.txt as PCME ships them
# (naver-ai/pcme datasets/annotations/cub: trainval/test = Xian et al.'s 150/50 classes, and
# three train/val folds of trainval).
CAPTION_SPLITS = {
    "coco_karpathy": ("train", "restval", "val", "test"),
    "flickr30k": ("train", "val", "test"),
    "cub": ("trainval", "test", "train1", "val1", "train2", "val2", "train3", "val3"),
}
DEFAULT_SPLITS = {"coco_karpathy": ("train", "restval"), "flickr30k": ("train",),
                  "cub": ("trainval",)}
CAPTION_SOURCES = tuple(CAPTION_SPLITS)
_NOISE_TAG = 0x9C0C   # mixes noise_seed apart from the other seeded draws
_SAMPLE_CHECKED = 32   # images stat-ed at construction to catch a wrong image_root


class CaptionIndex:
    """The parsed annotations: images and their (image, caption) pairs.

    image_paths [I], image_ids int64 [I] (cocoid / imgid / CUB running index), class_ids
    int64 [I] | None (CUB: the NNN of NNN.Class_name, minus 1 as PCME), captions [N] (pair p's
    original caption is captions[p]; the pairs of image i are offsets[i]:offsets[i+1]),
    pair_image int64 [N], pair_caption int64 [N] (the caption pair p carries: p unless noisy),
    noisy int64 [K] (the corrupted pairs, sorted).
    """

    def __init__(self, name: str, files: Sequence[str], image_paths: Sequence[str],
                 image_ids: Sequence[int], captions: Sequence[Sequence[str]],
                 class_ids: Sequence[int] | None = None):
        self.name, self.files = name, list(files)
        self.image_paths = list(image_paths)
        self.image_ids = np.asarray(image_ids, np.int64)
        self.class_ids = None if class_ids is None else np.asarray(class_ids, np.int64)
        counts = np.array([len(c) for c in captions], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.captions = [c for per in captions for c in per]
        self.pair_image = np.repeat(np.arange(len(counts)), counts)
        self.pair_caption = np.arange(len(self.captions))
        self.noisy = np.zeros((0,), np.int64)
        self.noise_ratio, self.noise_seed = 0.0, 0
        if np.iinfo(np.int32).max < max(self.image_ids.max(initial=0), len(counts)):
            raise ValueError(f"{self.files[0]}: image ids do not fit int32")

    @property
    def num_images(self) -> int:
        return len(self.image_paths)

    @property
    def num_pairs(self) -> int:
        return len(self.captions)

    def positive_ids(self, level: str) -> np.ndarray:
        """int32 [I]: the id that makes pairs positives (equal ids = positives)."""
        if level == "class":
            if self.class_ids is None:
                raise ValueError(f"data.positive_level='class' needs class labels, which "
                                 f"{self.name} does not have (only cub)")
            return self.class_ids.astype(np.int32)
        return self.image_ids.astype(np.int32)

    def add_noise(self, ratio: float, seed: int) -> None:
        """Shuffles the captions of a seeded round(ratio * N) of the pairs among those pairs.

        As NCR (Huang et al. 2021; NCR data.py) picks a random subset of the captions and
        permutes it; here the permutation is one random cycle through the chosen pairs, so every
        chosen pair gets another pair's caption (a plain shuffle leaves ~1 in place) and the
        count is exact. NCR truncates (int(ratio * N)); we round. A caption can still land on a
        pair of its own image (odds ~ (captions per image - 1) / N per pair; written out as
        same_image). Fewer than 2 chosen pairs cannot be shuffled: none is corrupted."""
        n = self.num_pairs
        k = int(round(ratio * n))
        self.noise_ratio, self.noise_seed = float(ratio), int(seed)
        self.pair_caption = np.arange(n)
        if k < 2:
            if ratio > 0:
                log.warning("data.noise_ratio=%g of %d pairs chooses %d pair(s): nothing to "
                            "shuffle, no pair is corrupted.", ratio, n, k)
            self.noisy = np.zeros((0,), np.int64)
            return
        rng = np.random.default_rng((int(seed), _NOISE_TAG))
        chosen = rng.permutation(n)[:k]
        self.pair_caption[chosen] = np.roll(chosen, -1)
        self.noisy = np.sort(chosen)

    def noisy_pairs(self) -> list[dict[str, Any]]:
        """The corrupted pairs: index (pair), image_id, original_caption, new_caption,
        new_caption_index (the pair it came from), caption_image_id, same_image."""
        out = []
        for p in self.noisy.tolist():
            q = int(self.pair_caption[p])
            img, src = int(self.pair_image[p]), int(self.pair_image[q])
            out.append({"index": p, "image_id": int(self.image_ids[img]),
                        "original_caption": self.captions[p], "new_caption": self.captions[q],
                        "new_caption_index": q, "caption_image_id": int(self.image_ids[src]),
                        "same_image": img == src})
        return out


def write_noisy_pairs(index: CaptionIndex, path: str | os.PathLike) -> str:
    """Writes the corrupted pairs to `path` (.csv: one row per pair; otherwise JSON with the
    noise settings) atomically (a temporary file renamed over it). Returns the path."""
    path = os.fspath(path)
    rows = index.noisy_pairs()
    if path.endswith(".csv"):
        buf = io.StringIO()
        fields = ["index", "image_id", "original_caption", "new_caption", "new_caption_index",
                  "caption_image_id", "same_image"]
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    else:
        text = json.dumps({"source": index.name, "files": index.files,
                           "noise_ratio": index.noise_ratio, "noise_seed": index.noise_seed,
                           "num_pairs": index.num_pairs, "num_corrupted": len(rows),
                           "pairs": rows}, ensure_ascii=False, indent=1)
    fs.write_text_atomic(path, text)
    return path


# ------------------------------------------------------------------------------ readers
def _first(captions: Sequence[str], k: int | None) -> list[str]:
    return list(captions[:k]) if k else list(captions)


def read_karpathy(json_path: str, image_root: str, splits: Sequence[str], source: str,
                  captions_per_image: int | None) -> CaptionIndex:
    """A Karpathy split file (parsed by caption_files.read_karpathy) + its image root.
    captions_per_image: the first k sentences; None or 0: all (the COCO source asks for 5, as
    the retrieval evaluator and the 5-caption protocol)."""
    who = f"data.source={source!r}"
    name, entries = caption_files.read_karpathy(json_path, splits, who)
    ids, captions = [], []
    for i, e in enumerate(entries):
        sents = [s.get("raw", "").strip() if isinstance(s, dict) else "" for s in e["sentences"]]
        sents = [s for s in sents if s]
        if not sents:
            raise ValueError(f"{who}: {json_path}: the entry for {e['filename']!r} (split "
                             f"{e.get('split')!r}) has no captions")
        captions.append(_first(sents, captions_per_image))
        ids.append(int(e.get("cocoid", e.get("imgid", i))))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{who}: {json_path}: image ids (cocoid / imgid) repeat within splits "
                         f"{list(splits)}")
    flat = _image_layout(image_root, entries, json_path, who)
    paths = [caption_files.karpathy_image_path(image_root, e, flat) for e in entries]
    return CaptionIndex(source, [json_path], paths, ids, captions)


def _image_layout(image_root: str, entries: Sequence[dict], json_path: str, who: str) -> bool:
    """Whether images are image_root/filename (flat) rather than image_root/filepath/filename,
    from a sample of up to 32 entries; FileNotFoundError if none of them exists either way."""
    if not fs.isdir(image_root):
        raise FileNotFoundError(f"{who}: data.image_root {image_root!r} is not a directory")
    step = max(1, len(entries) // _SAMPLE_CHECKED)
    sample = entries[::step][:_SAMPLE_CHECKED]
    for flat in (False, True):
        if any(fs.isfile(caption_files.karpathy_image_path(image_root, e, flat))
               for e in sample):
            return flat
    e = sample[0]
    raise FileNotFoundError(
        f"{who}: none of {len(sample)} sampled images of {json_path} is under data.image_root "
        f"{image_root!r}, e.g. entry {e['filename']!r}: neither "
        f"{caption_files.karpathy_image_path(image_root, e)} nor "
        f"{caption_files.karpathy_image_path(image_root, e, flat=True)} exists")


def read_cub(root: str, splits: Sequence[str], split_dir: str = "",
             captions_per_image: int | None = None) -> CaptionIndex:
    """CUB Captions (images/ + text_c10/ under root) for the classes of <split>classes.txt.
    Images in class-folder order, then file name order; image id = position in that order;
    class id = NNN - 1 of the folder NNN.Class_name (PCME cub.py)."""
    who = "data.source='cub'"
    images_dir, text_dir = fs.join(root, "images"), fs.join(root, "text_c10")
    for d in (images_dir, text_dir):
        if not fs.isdir(d):
            raise FileNotFoundError(f"{who}: {d!r} does not exist (data.image_root must hold "
                                    "images/ and text_c10/)")
    classes: dict[str, str] = {}   # class folder -> the split file that named it
    for split in splits:
        split_file = fs.join(split_dir or root, f"{split}classes.txt")
        names = caption_files.read_list(split_file, f"{who} class split")
        if not names:
            raise ValueError(f"{who}: class split file {split_file} names no class")
        for name in names:
            classes.setdefault(name.strip(), split_file)
    paths, class_ids, captions = [], [], []
    for cls in sorted(classes):
        split_file = classes[cls]
        try:
            cid = int(cls.split(".", 1)[0]) - 1
        except ValueError:
            raise ValueError(f"{who}: {split_file}: class {cls!r} is not a CUB class folder "
                             "name NNN.Class_name") from None
        img_dir, txt_dir = fs.join(images_dir, cls), fs.join(text_dir, cls)
        if not fs.isdir(img_dir):
            raise FileNotFoundError(f"{who}: {split_file}: class {cls!r} has no image folder "
                                    f"{img_dir}")
        if not fs.isdir(txt_dir):
            raise FileNotFoundError(f"{who}: {split_file}: class {cls!r} has no caption folder "
                                    f"{txt_dir}")
        imgs = {os.path.splitext(f)[0]: f for f in fs.listdir(img_dir)
                if f.lower().endswith(caption_files.IMAGE_EXTENSIONS)}
        txts = {os.path.splitext(f)[0]: f for f in fs.listdir(txt_dir) if f.endswith(".txt")}
        for stem in sorted(set(txts) - set(imgs)):
            raise ValueError(f"{who}: caption file {fs.join(txt_dir, txts[stem])} has no "
                             f"matching image in {img_dir}")
        for stem in sorted(set(imgs) - set(txts)):
            raise ValueError(f"{who}: image {fs.join(img_dir, imgs[stem])} has no caption "
                             f"file {stem}.txt in {txt_dir}")
        if not imgs:
            raise FileNotFoundError(f"{who}: {split_file}: class {cls!r} has no images in "
                                    f"{img_dir}")
        for stem in sorted(imgs):
            txt_path = fs.join(txt_dir, txts[stem])
            with io.TextIOWrapper(fs.open(txt_path, "rb"), encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
            if not lines:
                raise ValueError(f"{who}: caption file {txt_path} holds no caption")
            paths.append(fs.join(img_dir, imgs[stem]))
            class_ids.append(cid)
            captions.append(_first(lines, captions_per_image))
    files = sorted(set(classes.values()))
    return CaptionIndex("cub", files, paths, range(len(paths)), captions, class_ids)


# ------------------------------------------------------------------------------ the source
class CaptionSource:
    """Random-access records for grain: [r] -> {"path", "txt", "image_id", "key"}, no I/O
    (the image is read by ToRaw, in the reading threads / worker processes).
    per_caption: r is a pair (txt its caption); per_image: r is an image (txt its captions)."""

    def __init__(self, index: CaptionIndex, iteration: str, positive_level: str):
        self.index, self.iteration = index, iteration
        self.ids = index.positive_ids(positive_level)

    def __len__(self) -> int:
        return self.index.num_pairs if self.iteration == "per_caption" else self.index.num_images

    def __getitem__(self, r: int) -> dict[str, Any]:
        ix = self.index
        if self.iteration == "per_caption":
            img = int(ix.pair_image[r])
            txt: Any = ix.captions[int(ix.pair_caption[r])]
            key = f"{ix.name} pair {r}"
        else:
            img = int(r)
            txt = [ix.captions[int(q)] for q in ix.pair_caption[ix.offsets[r]:ix.offsets[r + 1]]]
            key = f"{ix.name} image {r}"
        return {"path": ix.image_paths[img], "txt": txt, "image_id": int(self.ids[img]),
                "key": key}


class ToRaw:
    """(epoch, record index, element) -> raw record (records.py), or Skip("missing_image") when
    the image file cannot be read. An element is {"path", "txt", "key"}, with "image_id" for the
    caption sources (CaptionSource) and without it for listings (sources/csv_listing.py)."""

    def __call__(self, item: tuple[int, int, Any] | Skip) -> dict[str, Any] | Skip:
        if isinstance(item, Skip):
            return item
        epoch, index, element = item
        try:
            data = fs.read_bytes(element["path"])
        except OSError:   # absent, a directory, unreadable: skipped and counted
            return Skip("missing_image", element["path"])
        ids = {"image_id": element["image_id"]} if "image_id" in element else {}
        return {"image": data, "txt": element["txt"], "key": element["key"], "label": None, **ids,
                "rng_key": (epoch, index)}
