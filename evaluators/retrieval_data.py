"""The retrieval evaluator's data readers (evaluators/retrieval.py `load_data`): image-caption
sets as `input_pipeline.eval_data.EvalSet`s, images read sharded over the hosts, captions known
to every host.

    karpathy(json, image_root, split)     COCO / Flickr30K Karpathy split files (+ COCO caption
                                          ids for ECCV Caption / CxC)
    cub_captions(root, split)             CUB Captions, class ids for class-level positives
    tfds_captions(name, split)            tfds coco_captions (real COCO ids)
    image_text_tars(path)                 held-out tar shards in the training layout
    coco_category_codes(files, image_ids) COCO instance categories per image (PMRP)
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from typing import Any, Sequence

import numpy as np

from input_pipeline import shards as paths_lib
from input_pipeline.caption_files import karpathy_image_path, need, read_karpathy
from input_pipeline.captions import read_cub
from input_pipeline.eval_data import EvalSet, Files, Records, TarImages, Tfds
from input_pipeline.sources.tfds import tfds_source
from input_pipeline.tar_source import IMAGE_EXTS, TEXT_EXT, split_key


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def _coco_caption_ids(files: Sequence[str]) -> dict[tuple[int, str], int]:
    """(COCO image id, normalised caption) -> caption annotation id, from captions_*.json."""
    table: dict[tuple[int, str], int] = {}
    for f in files:
        with open(need(f, "COCO captions annotation file")) as fh:
            for a in json.load(fh)["annotations"]:
                table[(int(a["image_id"]), _norm_text(a["caption"]))] = int(a["id"])
    return table


def _coco_5k_ids() -> tuple[set[int], set[int]] | None:
    """(image ids, caption ids) of the COCO 5K test set as eccv_caption ships them, or None."""
    try:
        import eccv_caption  # optional dependency (pip install eccv_caption): imported where used
    except ImportError:
        return None
    data = os.path.join(os.path.dirname(eccv_caption.__file__), "data")
    with open(os.path.join(data, "original_image_to_caption.json")) as f:
        images = {int(k) for k in json.load(f)}
    return images, set(np.load(os.path.join(data, "coco_test_ids.npy")).tolist())


def karpathy(json_path: str, image_root: str, split: str = "test",
             captions_per_image: int | None = None, coco_annotations: Sequence[str] = ()
             ) -> EvalSet:
    """A Karpathy-split file (dataset_coco.json / dataset_flickr30k.json) + its image folder.

    Images at `image_root/filepath/filename` (COCO) or `image_root/filename` (Flickr30k).
    COCO caption annotation ids (for eccv_caption) come from a sentence's "id" field or from
    `coco_annotations` (captions_{train,val}2014.json) matched on (cocoid, text). For COCO with
    known ids and eccv_caption installed, the captions kept are the 5K protocol's (its ids);
    otherwise the first `captions_per_image` (default 5 for COCO, all otherwise).
    info: image_ids (COCO only) and caption_ids (when all are known).
    """
    name, entries = read_karpathy(json_path, (split,), "retrieval evaluator")
    is_coco = name == "coco"
    if captions_per_image is None and is_coco:
        captions_per_image = 5
    ann = _coco_caption_ids(coco_annotations) if coco_annotations else {}
    coco_5k = _coco_5k_ids() if is_coco else None

    paths, captions, cap_img, image_ids, cap_ids = [], [], [], [], []
    for i, e in enumerate(entries):
        p = karpathy_image_path(image_root, e)
        if not os.path.exists(p):
            p = need(karpathy_image_path(image_root, e, flat=True), "image")
        paths.append(p)
        image_ids.append(int(e.get("cocoid", e.get("imgid", i))))
        sents = []
        for s in e["sentences"]:
            cid = s.get("id", ann.get((image_ids[-1], _norm_text(s["raw"]))))
            sents.append((s["raw"], None if cid is None else int(cid)))
        known = all(c is not None for _, c in sents)
        if known and coco_5k is not None and image_ids[-1] in coco_5k[0]:
            sents = [x for x in sents if x[1] in coco_5k[1]]   # the 5K protocol's 5 captions
        elif captions_per_image:
            sents = sents[:captions_per_image]
        for raw, cid in sents:
            captions.append(raw)
            cap_img.append(i)
            cap_ids.append(cid)
    ids_known = all(c is not None for c in cap_ids)
    info = {"image_ids": np.asarray(image_ids, np.int64) if is_coco else None,
            "caption_ids": np.asarray(cap_ids, np.int64) if ids_known else None}
    return EvalSet(name, Records(len(paths), Files(paths)), captions,
                   np.asarray(cap_img, np.int64), info)


def tfds_captions(tfds_name: str = "coco_captions", split: str = "test",
                  data_dir: str | None = None) -> EvalSet:
    """tfds `coco_captions` (its "test" split is the Karpathy 5K test set; real COCO ids)."""
    src = tfds_source(tfds_name, split, data_dir)
    captions, cap_img, cap_ids, image_ids = [], [], [], []
    for i in range(len(src)):   # every host reads the captions (small next to the images)
        ex = src[i]
        image_ids.append(int(ex["image/id"]))
        for t, cid in zip(ex["captions"]["text"], ex["captions"]["id"]):
            captions.append(t.decode() if isinstance(t, bytes) else str(t))
            cap_img.append(i)
            cap_ids.append(int(cid))
    return EvalSet("coco" if "coco" in tfds_name else tfds_name, Records(len(src), Tfds(src)),
                   captions, np.asarray(cap_img, np.int64),
                   {"image_ids": np.asarray(image_ids), "caption_ids": np.asarray(cap_ids)})


# ------------------------------------------------------------------------------ COCO categories, CUB
COCO_CATEGORY_SLOTS = 90   # COCO category ids run 1..90 (80 used), as PCME's / DAA's codes


def coco_category_codes(files: Sequence[str], image_ids: Sequence[int]
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(codes bool [N, 90], annotated bool [N]) of the given COCO image ids from instances
    files (instances_{train,val}2014.json: `annotations[].image_id`, `.category_id`, and
    `images[].id`): codes[i, category_id - 1] = 1 when image i has an instance of the category
    (the 90-slot layout of PCME's evaluate_pmrp_coco.py, for PMRP). annotated[i] = False for an
    image without any instance (listed in `images` but never in `annotations`).
    An image id in none of the files' `images` is an error naming the files and the id (the
    wrong file for the split, e.g. train2014 instances for Karpathy test images, which are val)."""
    files = [files] if isinstance(files, str) else list(files)
    ids = np.asarray(image_ids, np.int64)
    where = {int(x): i for i, x in enumerate(ids)}
    width, found = COCO_CATEGORY_SLOTS, []
    listed: set[int] | None = None
    for f in files:
        with open(need(f, "COCO instances file")) as fh:
            meta = json.load(fh)
        if "images" in meta:
            listed = (listed or set()) | {int(im["id"]) for im in meta["images"]}
        width = max([width] + [int(c["id"]) for c in meta.get("categories", [])])
        for a in meta.get("annotations", []):
            i = where.get(int(a["image_id"]))
            if i is not None:
                cat = int(a["category_id"])
                if cat < 1:
                    raise ValueError(f"{f}: category_id {cat} < 1 (COCO ids start at 1)")
                found.append((i, cat - 1))
                width = max(width, cat)
    codes = np.zeros((len(ids), width), bool)
    for i, j in found:
        codes[i, j] = True
    if listed is not None:
        missing = [int(x) for x in ids if int(x) not in listed]
        if missing:
            raise ValueError(f"COCO instances file(s) {', '.join(files)}: {len(missing)} of "
                             f"{len(ids)} image ids of the split are not in their `images` "
                             f"(e.g. image id {missing[0]}); name the instances file(s) of the "
                             f"split's images (instances_val2014.json for the Karpathy test split)")
    return codes, codes.any(1)


def cub_captions(root: str, split: str = "test", split_dir: str = "") -> EvalSet:
    """CUB Captions (Reed et al. 2016; the PCME protocol, DAA §5.1.1), read by the
    training source's parser (input_pipeline/captions.py `read_cub`, the one place for the
    layout): root/images/<NNN.Class>/<name>.jpg, root/text_c10/<NNN.Class>/<name>.txt (10 lines),
    the classes of <split_dir or root>/<split>classes.txt (Xian et al.'s testclasses.txt).
    Every caption of an image is kept. info: class_ids int64 [N] (NNN - 1, as PCME),
    classnames, captions_per_record."""
    index = read_cub(root, (split,), split_dir, captions_per_image=0)
    info = {"class_ids": index.class_ids,
            "classnames": sorted({os.path.basename(os.path.dirname(p)) for p in index.image_paths}),
            "captions_per_record": int(np.diff(index.offsets).max())}
    return EvalSet("cub", Records(index.num_images, Files(index.image_paths)), list(index.captions),
                   index.pair_image.astype(np.int64), info)


# ------------------------------------------------------------------------------ training-format tar shards
def image_text_tars(path: str | Sequence[str], name: str = "tar", limit: int = 0) -> EvalSet:
    """Image-caption pairs from tar shards in the training layout (input_pipeline/tar_source.py:
    `<key>.<jpg|png|webp|...>` + `<key>.txt`, one caption per image), e.g. a held-out shard for
    retrieval. `path`: files, globs or brace patterns ('val/{0000..0003}.tar'). Headers are read
    once to index the samples; images stay in the tars and are read at their offsets. Samples
    without an image or a caption are left out, as training skips them; `limit`: the first N."""
    shards = paths_lib.expand_paths(path)
    samples: dict[tuple[str, str], dict[str, Any]] = {}
    for shard in shards:
        with tarfile.open(shard) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = split_key(m.name)
                s = samples.setdefault((shard, key), {})
                if ext in IMAGE_EXTS:
                    s.setdefault("image", (shard, m.offset_data, m.size))
                elif ext == TEXT_EXT:
                    s["txt"] = tf.extractfile(m).read().decode("utf-8", "replace").strip()
    rows = [s for s in samples.values() if "image" in s and s.get("txt")]
    if limit:
        rows = rows[:limit]
    if not rows:
        raise FileNotFoundError(f"no image + caption samples in the tar shards {shards[:3]}")
    return EvalSet(name, Records(len(rows), TarImages([s["image"] for s in rows], None)),
                   [s["txt"] for s in rows], np.arange(len(rows), dtype=np.int64),
                   {"captions_per_record": 1})
