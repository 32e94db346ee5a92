"""Evaluation sets: records for `build_eval_iterator` plus what every host knows up front.

    es = eval_data.demo("retrieval", demo_kwargs)           # or imagefolder / karpathy / tfds ...
    for batch in es.batches(global_batch, image_size):      # this host's share, padded, masked
        ...                                                 # {"image" uint8, "mask", "index", ["label"]}
    es.captions, es.caption_record                          # every caption and its record

Images are read through the input pipeline (host h reads records h, h+P, ...; decode + eval
transform; failed records become mask=False rows). Captions are small and known to every host:
they are tokenised and encoded apart (prolip_jax.encode.Encoder.texts).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from input_pipeline import records

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".webp")


@dataclasses.dataclass
class EvalSet:
    """records: random access, len() and [i] -> raw record {"image", "txt", "key", "label"}.
    captions [M] with caption_record int [M] (the record of each caption), or None.
    info: anything else the set knows (classnames, templates, image_ids, caption_ids, tokens)."""
    name: str
    records: Any
    captions: list[str] | None = None
    caption_record: np.ndarray | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def batches(self, batch_size: int, image_size: int, normalization: str = "openai",
                threads: int = 8) -> Any:
        """The eval iterator over the images: batch_size is GLOBAL (B/P rows per host)."""
        from input_pipeline.pipeline import build_eval_iterator

        cfg = dict(source="array_record", path=self.name, batch_size=batch_size,
                   image_size=image_size, normalization=normalization, image_dtype="uint8",
                   read_threads=max(1, threads), min_image_side=1)
        return build_eval_iterator(cfg, source=self.records)


# ------------------------------------------------------------------------------ record sources
class _Records:
    """records[i] -> raw record, from a per-index reader (picklable, random access)."""

    def __init__(self, n: int, read: Any):
        self.n, self.read = n, read

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.read(i)


class _Files:
    def __init__(self, paths: Sequence[str], labels: Sequence[int] | None = None):
        self.paths, self.labels = list(paths), labels

    def __call__(self, i: int) -> dict[str, Any]:
        with open(self.paths[i], "rb") as f:
            data = f.read()
        label = None if self.labels is None else int(self.labels[i])
        return {"image": data, "txt": self.paths[i], "key": self.paths[i], "label": label}


class _ArrayRecord:
    """Records of this project's format; `label_key` picks the label from the record's meta."""

    def __init__(self, path: str, label_key: str | None):
        import grain
        self.src = grain.sources.ArrayRecordDataSource([path])
        self.label_key = label_key

    def __call__(self, i: int) -> dict[str, Any]:
        rec = records.decode_record(self.src[i])
        label = rec["meta"].get(self.label_key) if self.label_key else None
        return {"image": rec["image"], "txt": rec.get("key") or str(i), "key": rec.get("key", ""),
                "label": label}

    def header(self, i: int) -> dict[str, Any]:
        return records.decode_record(self.src[i])


class _Arrays:
    def __init__(self, images: np.ndarray):
        self.images = images

    def __call__(self, i: int) -> dict[str, Any]:
        return {"image": np.asarray(self.images[i]), "txt": str(i), "key": str(i), "label": None}


class _Tfds:
    def __init__(self, src: Any, image_key: str = "image", label_key: str | None = None,
                 label_map: Sequence[int] | None = None):
        self.src, self.image_key, self.label_key = src, image_key, label_key
        self.label_map = None if label_map is None else np.asarray(label_map, np.int64)

    def __call__(self, i: int) -> dict[str, Any]:
        ex = self.src[i]
        label = int(ex[self.label_key]) if self.label_key else None
        if label is not None and self.label_map is not None:
            label = int(self.label_map[label])   # -1: not in the subset (a mismatch upstream)
        return {"image": ex[self.image_key], "txt": f"tfds #{i}", "key": f"tfds #{i}",
                "label": label}


# ------------------------------------------------------------------------------ the sets
def demo(split: str, demo_kwargs: Mapping[str, Any] | None = None, task: str | None = None
         ) -> EvalSet:
    """A demo split ("zeroshot", "retrieval", "levels"), with its tokenizer in info.

    zeroshot: label = the task's label_key, info classnames / templates of `task` ("object" |
    "shape"). retrieval: one caption per record. levels: the 4 caption levels of each record."""
    from input_pipeline.demo import get_demo

    ds = get_demo(**dict(demo_kwargs or {}))
    info: dict[str, Any] = {"tokenizer": ds.tokenizer, "demo": ds}
    label_key = None
    if split == "zeroshot":
        task = task or "object"
        if task not in ds.zeroshot_tasks:
            raise ValueError(f"unknown demo task {task!r}; known: {sorted(ds.zeroshot_tasks)}")
        t = ds.zeroshot_tasks[task]
        label_key = t["label_key"]
        info.update(classnames=list(t["classnames"]), templates=list(t["templates"]), task=task)
    reader = _ArrayRecord(ds.split_path(split), label_key)
    n = len(reader.src)
    es = EvalSet(task if split == "zeroshot" else "demo", _Records(n, reader), info=info)
    if split != "zeroshot":
        txt = [reader.header(i)["txt"] for i in range(n)]
        per = [[t] if isinstance(t, str) else list(t) for t in txt]
        es.captions = [c for p in per for c in p]
        es.caption_record = np.repeat(np.arange(n), [len(p) for p in per])
        es.info["captions_per_record"] = len(per[0]) if per else 1
    return es


def read_list(path: str, what: str) -> list[str]:
    """A JSON list or a text file, one item per line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    with open(path) as f:
        if path.endswith(".json"):
            out = json.load(f)
            if not isinstance(out, list):
                raise ValueError(f"{what} file {path!r} must hold a JSON list")
            return [str(x) for x in out]
        return [line.rstrip("\n") for line in f if line.strip()]


def read_class_index(path: str) -> dict[str, int]:
    """class_dir -> index from a JSON dict / list, a Keras-style JSON or a text file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"class-index file {path!r} does not exist")
    if not path.endswith(".json"):
        return {name: i for i, name in enumerate(read_list(path, "class-index"))}
    with open(path) as f:
        raw = json.load(f)
    if isinstance(raw, list):
        return {str(name): i for i, name in enumerate(raw)}
    if all(isinstance(v, (list, tuple)) for v in raw.values()):   # {"0": ["n01440764", "tench"]}
        return {str(v[0]): int(k) for k, v in raw.items()}
    return {str(k): int(v) for k, v in raw.items()}


def imagefolder_classes(root: str, split: str, class_index: Any = ""
                        ) -> tuple[list[str], dict[str, int]]:
    """(the sorted class dirs of <root>/<split>, class_dir -> label).
    class_index: a file (see read_class_index), a {class_dir: index} mapping, a list of class
    dirs in label order, or "" (sorted order, torchvision ImageFolder's convention)."""
    base = os.path.join(root, split)
    if not os.path.isdir(base):
        raise FileNotFoundError(f"ImageFolder split directory {base!r} does not exist")
    dirs = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if isinstance(class_index, Mapping):
        index = {str(k): int(v) for k, v in class_index.items()}
    elif isinstance(class_index, (list, tuple)):
        index = {str(d): i for i, d in enumerate(class_index)}
    else:
        index = read_class_index(class_index) if class_index else {d: i for i, d in enumerate(dirs)}
    unknown = [d for d in dirs if d not in index]
    if unknown:
        raise ValueError(f"class dirs {unknown[:5]} of {base!r} are not in the class index")
    return dirs, index


def imagefolder_files(root: str, split: str, class_index: Any = ""
                      ) -> tuple[list[str], np.ndarray]:
    """(image paths, labels int32 [N]) of <root>/<split>/<class_dir>/*.<image extension>
    (class_index: see imagefolder_classes)."""
    dirs, index = imagefolder_classes(root, split, class_index)
    base = os.path.join(root, split)
    files, labels = [], []
    for d in dirs:
        for name in sorted(os.listdir(os.path.join(base, d))):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                files.append(os.path.join(base, d, name))
                labels.append(index[d])
    if not files:
        raise FileNotFoundError(f"no images under {base!r}")
    return files, np.asarray(labels, np.int32)


def imagefolder(root: str, split: str = "val", class_index: Any = "",
                name: str = "imagenet", limit: int = 0) -> EvalSet:
    """info["labels"]: int32 [N] (known up front, like the other classification sets);
    info["class_dirs"] (sorted) and info["class_index"] {class_dir: label}, so that whoever
    names the classes can check the names against the folders."""
    dirs, index = imagefolder_classes(root, split, class_index)
    files, labels = imagefolder_files(root, split, index)
    n = min(limit, len(files)) if limit else len(files)
    return EvalSet(name, _Records(n, _Files(files, labels)),
                   info={"labels": labels[:n], "class_dirs": dirs, "class_index": index,
                         "where": os.path.join(root, split),
                         "class_index_given": bool(len(class_index))})


def tfds_classification(tfds_name: str = "imagenet2012", split: str = "validation",
                        data_dir: str | None = None, name: str = "imagenet", limit: int = 0,
                        label_map: Sequence[int] | None = None) -> EvalSet:
    """A tfds classification set prepared as array_record (images stay encoded until read).
    label_map: tfds label -> label (e.g. ImageNet-1k index -> index in a 200-class subset).
    info["num_classes"]: the tfds label feature's number of classes, when it has one."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("dataset='tfds' needs tensorflow_datasets installed") from e
    if data_dir is not None and not os.path.isdir(data_dir):
        raise FileNotFoundError(f"tfds data_dir {data_dir!r} does not exist")
    try:
        src = tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False,
                               decoders={"image": tfds.decode.SkipDecoding()})
    except Exception as e:  # pylint: disable=broad-except
        raise FileNotFoundError(f"tfds {tfds_name} ({split}) is not prepared under "
                                f"{data_dir or 'the default data_dir'}: {e}") from e
    n = min(limit, len(src)) if limit else len(src)
    info: dict[str, Any] = {}
    try:
        info["num_classes"] = int(src.dataset_info.features["label"].num_classes)
    except Exception:  # pylint: disable=broad-except  (no label feature info: not checked)
        pass
    reader = _Tfds(src, label_key="label", label_map=label_map)
    return EvalSet(name, _Records(n, reader), info=info)


def arrays(images: np.ndarray, name: str) -> EvalSet:
    """uint8 images [N, H, W, 3] held in memory (e.g. an .npz analysis set)."""
    return EvalSet(name, _Records(len(images), _Arrays(images)))


# ------------------------------------------------------------------------------ image-caption sets
def _need(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"retrieval evaluator: {what} not found: {path}")
    return path


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def _coco_caption_ids(files: Sequence[str]) -> dict[tuple[int, str], int]:
    """(COCO image id, normalised caption) -> caption annotation id, from captions_*.json."""
    table: dict[tuple[int, str], int] = {}
    for f in files:
        with open(_need(f, "COCO captions annotation file")) as fh:
            for a in json.load(fh)["annotations"]:
                table[(int(a["image_id"]), _norm_text(a["caption"]))] = int(a["id"])
    return table


def _coco_5k_ids() -> tuple[set[int], set[int]] | None:
    """(image ids, caption ids) of the COCO 5K test set as eccv_caption ships them, or None."""
    try:
        import eccv_caption
    except ImportError:
        return None
    data = os.path.join(os.path.dirname(eccv_caption.__file__), "data")
    with open(os.path.join(data, "original_image_to_caption.json")) as f:
        images = {int(k) for k in json.load(f)}
    return images, set(np.load(os.path.join(data, "coco_test_ids.npy")).tolist())


def read_karpathy(json_path: str, splits: Sequence[str], who: str = "Karpathy split"
                  ) -> tuple[str, list[dict[str, Any]]]:
    """(dataset name, the entries of `splits` in file order) of a Karpathy split file
    (dataset_coco.json / dataset_flickr30k.json: {"dataset", "images": [{"filepath"?,
    "filename", "split", "cocoid" | "imgid", "sentences": [{"raw"}, ...]}, ...]}).
    Shared by the retrieval evaluator (karpathy) and the training source (captions.py);
    errors name the file and, for a malformed entry, the entry."""
    with open(_need(json_path, "Karpathy split file")) as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or not isinstance(meta.get("images"), list):
        raise ValueError(f"{who}: {json_path} is not a Karpathy split file (no 'images' list)")
    name = meta.get("dataset", os.path.splitext(os.path.basename(json_path))[0])
    entries = []
    for i, e in enumerate(meta["images"]):
        if not isinstance(e, dict) or "filename" not in e or "sentences" not in e:
            raise ValueError(f"{who}: {json_path} entry {i} lacks 'filename' or 'sentences': "
                             f"{str(e)[:200]}")
        if e.get("split") in splits:
            entries.append(e)
    if not entries:
        raise ValueError(f"{who}: no images with split {' or '.join(map(repr, splits))} in "
                         f"{json_path}")
    return name, entries


def karpathy_image_path(image_root: str, entry: Mapping[str, Any], flat: bool = False) -> str:
    """image_root/filepath/filename (COCO's train2014/, val2014/), or image_root/filename
    (flat=True; Flickr30K, or COCO images gathered in one folder)."""
    if flat:
        return os.path.join(image_root, entry["filename"])
    return os.path.join(image_root, entry.get("filepath", ""), entry["filename"])


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
            p = _need(karpathy_image_path(image_root, e, flat=True), "image")
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
    return EvalSet(name, _Records(len(paths), _Files(paths)), captions,
                   np.asarray(cap_img, np.int64), info)


def tfds_captions(tfds_name: str = "coco_captions", split: str = "test",
                  data_dir: str | None = None) -> EvalSet:
    """tfds `coco_captions` (its "test" split is the Karpathy 5K test set; real COCO ids)."""
    from input_pipeline.sources import tfds_source

    src = tfds_source(tfds_name, split, data_dir)
    captions, cap_img, cap_ids, image_ids = [], [], [], []
    for i in range(len(src)):   # every host reads the captions (small next to the images)
        ex = src[i]
        image_ids.append(int(ex["image/id"]))
        for t, cid in zip(ex["captions"]["text"], ex["captions"]["id"]):
            captions.append(t.decode() if isinstance(t, bytes) else str(t))
            cap_img.append(i)
            cap_ids.append(int(cid))
    return EvalSet("coco" if "coco" in tfds_name else tfds_name, _Records(len(src), _Tfds(src)),
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
        with open(_need(f, "COCO instances file")) as fh:
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
    """CUB Captions (Reed et al. 2016; the PCME protocol, DAA seed 004 §5.1.1), read by the
    training source's parser (input_pipeline/captions.py `read_cub`, the one place for the
    layout): root/images/<NNN.Class>/<name>.jpg, root/text_c10/<NNN.Class>/<name>.txt (10 lines),
    the classes of <split_dir or root>/<split>classes.txt (Xian et al.'s testclasses.txt).
    Every caption of an image is kept. info: class_ids int64 [N] (NNN - 1, as PCME),
    classnames, captions_per_record."""
    from input_pipeline.captions import read_cub

    index = read_cub(root, (split,), split_dir, captions_per_image=0)
    info = {"class_ids": index.class_ids,
            "classnames": sorted({os.path.basename(os.path.dirname(p)) for p in index.image_paths}),
            "captions_per_record": int(np.diff(index.offsets).max())}
    return EvalSet("cub", _Records(index.num_images, _Files(index.image_paths)), list(index.captions),
                   index.pair_image.astype(np.int64), info)


# ------------------------------------------------------------------------------ HierarCaps
HIERARCAPS_LEVELS = 4


def hierarcaps(csv_path: str, image_dir: str, limit: int = 0) -> EvalSet:
    """The HierarCaps test set (Alper & Averbuch-Elor 2024; github.com/TAU-VAILab/hierarcaps,
    data/hierarcaps_test.csv): a CSV with header `id,captions,image_url`, `captions` the four
    levels general -> specific joined by "=>" (level 3 is the original COCO caption), and
    `image_url` a COCO val2014 URL (.../COCO_val2014_000000301718.jpg).

    Images are found in `image_dir` by the URL's file name (COCO_val2014_*.jpg, as the ProLIP
    reference), else by the COCO 2017 name <id:012d>.jpg (the same val images). One record per
    CSV row (a COCO image may appear in several rows, as in the reference's evaluation).
    captions: 4 per record, level-major within a record; info: levels=4, ids, image_ids.
    """
    import csv

    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"HierarCaps CSV {csv_path!r} does not exist (hierarcaps_test.csv "
                                "from github.com/TAU-VAILab/hierarcaps, data/)")
    if not os.path.isdir(image_dir):
        raise FileNotFoundError(f"HierarCaps image_dir {image_dir!r} does not exist (COCO val2014 "
                                "or val2017 images)")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"captions", "image_url"} <= set(rows[0]):
        raise ValueError(f"{csv_path}: expected a CSV with columns id,captions,image_url")
    if limit:
        rows = rows[:limit]
    paths, captions, ids, image_ids, missing = [], [], [], [], []
    for n, row in enumerate(rows):
        levels = [c.strip() for c in row["captions"].split("=>")]
        if len(levels) != HIERARCAPS_LEVELS or not all(levels):
            raise ValueError(f"{csv_path} row {n}: {len(levels)} caption levels, expected "
                             f"{HIERARCAPS_LEVELS} non-empty ones joined by '=>'")
        name = row["image_url"].rstrip("/").split("/")[-1]
        match = re.search(r"(\d+)\.\w+$", name)
        image_id = int(match.group(1)) if match else -1
        path = next((p for p in (os.path.join(image_dir, name),
                                 os.path.join(image_dir, f"{image_id:012d}.jpg"))
                     if os.path.isfile(p)), None)
        if path is None:
            missing.append(name)
        paths.append(path)
        captions += levels
        ids.append(row.get("id", str(n)))
        image_ids.append(image_id)
    if missing:
        raise FileNotFoundError(f"HierarCaps: {len(missing)} of {len(rows)} images not in "
                                f"{image_dir!r} (e.g. {missing[0]}; also tried <id:012d>.jpg)")
    info = {"levels": HIERARCAPS_LEVELS, "ids": ids, "image_ids": np.asarray(image_ids, np.int64),
            "captions_per_record": HIERARCAPS_LEVELS}
    return EvalSet("hierarcaps", _Records(len(paths), _Files(paths)), captions,
                   np.repeat(np.arange(len(paths)), HIERARCAPS_LEVELS), info)


# ------------------------------------------------------------------------------ clip_benchmark webdataset
WDS_IMAGE_EXTS = ("webp", "png", "jpg", "jpeg")   # clip_benchmark build_wds_dataset's order


class _TarImages:
    """records[i] -> the image bytes of sample i, read at (shard, offset, size)."""

    def __init__(self, where: Sequence[tuple[str, int, int]], labels: Sequence[int] | None):
        self.where, self.labels = list(where), labels

    def __call__(self, i: int) -> dict[str, Any]:
        path, offset, size = self.where[i]
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        label = None if self.labels is None else int(self.labels[i])
        return {"image": data, "txt": f"{path}#{i}", "key": f"{path}#{i}", "label": label}


def _wds_shards(split_dir: str) -> list[str]:
    """<split>/0.tar ... (n-1).tar from nshards.txt, else every *.tar in numeric/name order."""
    nshards = os.path.join(split_dir, "nshards.txt")
    if os.path.exists(nshards):
        with open(nshards) as f:
            return [os.path.join(split_dir, f"{i}.tar") for i in range(int(f.read().strip()))]
    names = [n for n in os.listdir(split_dir) if n.endswith(".tar")]
    key = lambda n: (0, int(n[:-4]), n) if n[:-4].isdigit() else (1, 0, n)
    return [os.path.join(split_dir, n) for n in sorted(names, key=key)]


def read_lines(path: str) -> list[str] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [line.strip() for line in f.read().splitlines() if line.strip()]


def webdataset(folder: str, split: str = "test", name: str | None = None) -> EvalSet:
    """A clip_benchmark / DataComp webdataset folder, read locally with random access:

        folder/<split>/{nshards.txt, 0.tar, 1.tar, ...}   samples <key>.{webp|png|jpg|jpeg}
                                                          + <key>.cls (label) | <key>.txt (captions)
                                                          [+ <key>.npy (metadata row, WILDS)]
        folder/classnames.txt, zeroshot_classification_templates.txt, [dataset_type.txt]

    (the layout of clip_benchmark `build_wds_dataset` and of DataComp's download_evalsets.py).
    Every shard's headers are read once to index the samples; images stay encoded until read.
    info: dataset_type ("classification" | "retrieval"), classnames / templates (None when the
    file is absent), labels int64 [N] (classification), metadata [N, k] (when .npy are present).
    Retrieval folders give captions (one per line of each .txt) and caption_record."""
    import tarfile

    split_dir = os.path.join(folder, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"webdataset split directory {split_dir!r} does not exist")
    shards = _wds_shards(split_dir)
    missing = [s for s in shards if not os.path.exists(s)]
    if not shards or missing:
        raise FileNotFoundError(f"webdataset shards missing under {split_dir!r}: {missing[:3] or 'no .tar'}")
    kind = (read_lines(os.path.join(folder, "dataset_type.txt")) or ["classification"])[0].lower()
    samples: dict[str, dict[str, Any]] = {}
    for shard in shards:
        with tarfile.open(shard) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                # webdataset's key: the member path up to the first dot of its basename
                d, base = os.path.split(m.name)
                stem, _, ext = base.partition(".")
                s = samples.setdefault(f"{shard}:{d}/{stem}", {})
                ext = ext.lower()
                if ext in WDS_IMAGE_EXTS:
                    s.setdefault("image", (shard, m.offset_data, m.size))
                elif ext in ("cls", "txt", "npy"):
                    s[ext] = tf.extractfile(m).read()
    rows = [s for s in samples.values() if "image" in s]
    if not rows:
        raise FileNotFoundError(f"no images in the webdataset shards under {split_dir!r}")
    info: dict[str, Any] = {"dataset_type": kind}
    templates = read_lines(os.path.join(folder, "zeroshot_classification_templates.txt"))
    info["classnames"] = read_lines(os.path.join(folder, "classnames.txt"))
    info["templates"] = None if templates is None else [t.replace("{c}", "{}") for t in templates]
    name = name or os.path.basename(os.path.normpath(folder))
    where = [s["image"] for s in rows]
    if kind == "retrieval":
        per = [s.get("txt", b"").decode().splitlines() for s in rows]
        return EvalSet(name, _Records(len(rows), _TarImages(where, None)),
                       [c for p in per for c in p],
                       np.repeat(np.arange(len(rows)), [len(p) for p in per]), info)
    if any("cls" not in s for s in rows):
        raise ValueError(f"webdataset {folder!r}: some samples have no .cls label")
    labels = np.asarray([int(s["cls"].decode().strip()) for s in rows], np.int64)
    info["labels"] = labels
    if all("npy" in s for s in rows):
        import io
        info["metadata"] = np.stack([np.load(io.BytesIO(s["npy"])) for s in rows])
    return EvalSet(name, _Records(len(rows), _TarImages(where, labels)), info=info)


# ------------------------------------------------------------------------------ training-format tar shards
def image_text_tars(path: str | Sequence[str], name: str = "tar", limit: int = 0) -> EvalSet:
    """Image-caption pairs from tar shards in the training layout (input_pipeline/tar_source.py:
    `<key>.<jpg|png|webp|...>` + `<key>.txt`, one caption per image), e.g. a held-out shard for
    retrieval. `path`: files, globs or brace patterns ('val/{0000..0003}.tar'). Headers are read
    once to index the samples; images stay in the tars and are read at their offsets. Samples
    without an image or a caption are left out, as training skips them; `limit`: the first N."""
    import tarfile

    from input_pipeline import paths as paths_lib
    from input_pipeline.tar_source import IMAGE_EXTS, TEXT_EXT, split_key

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
    return EvalSet(name, _Records(len(rows), _TarImages([s["image"] for s in rows], None)),
                   [s["txt"] for s in rows], np.arange(len(rows), dtype=np.int64),
                   {"captions_per_record": 1})
