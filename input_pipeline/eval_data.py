"""Evaluation sets: records for `build_eval_iterator` plus what every host knows up front.

    es = eval_data.demo("retrieval", demo_kwargs)           # or imagefolder / tfds_classification
    for batch in es.batches(global_batch, image_size):      # this host's share, padded, masked
        ...                                                 # {"image" uint8, "mask", "index", ["label"]}
    es.captions, es.caption_record                          # every caption and its record

Images are read through the input pipeline (host h reads records h, h+P, ...; decode + eval
transform; failed records become mask=False rows). Captions are small and known to every host:
they are tokenised and encoded apart (prolip_jax.core.encode.Encoder.texts).

This module holds what several evaluators share: `EvalSet`, the record readers (files, tar
members, array_record, tfds examples, arrays), the demo splits, ImageFolder and tfds
classification sets. A reader that one evaluator alone uses lives beside that evaluator
(evaluators/retrieval_data.py: Karpathy, CUB, tfds captions, COCO categories, tar shards;
evaluators/hierarcaps.py: the HierarCaps CSV; evaluators/suite.py: clip_benchmark
webdatasets). Evaluators import this module; it imports no evaluator.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from input_pipeline import records
from input_pipeline.caption_files import IMAGE_EXTENSIONS, read_list
from input_pipeline.demo import get_demo
from input_pipeline.pipeline import build_eval_iterator


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
        cfg = dict(source="array_record", path=self.name, batch_size=batch_size,
                   image_size=image_size, normalization=normalization, image_dtype="uint8",
                   read_threads=max(1, threads), min_image_side=1)
        return build_eval_iterator(cfg, source=self.records)


# ------------------------------------------------------------------------------ record sources
class Records:
    """records[i] -> raw record, from a per-index reader (picklable, random access); the
    readers below (Files, TarImages, Tfds, ...) are what the evaluators' own readers build on."""

    def __init__(self, n: int, read: Any):
        self.n, self.read = n, read

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.read(i)


class Files:
    """Image files by path, with an optional label per file."""
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


class Tfds:
    """Examples of a tfds data source (images still encoded)."""
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


class TarImages:
    """records[i] -> the image bytes of sample i, read at (shard, offset, size) of a tar shard
    (webdatasets, training-format shards)."""

    def __init__(self, where: Sequence[tuple[str, int, int]], labels: Sequence[int] | None):
        self.where, self.labels = list(where), labels

    def __call__(self, i: int) -> dict[str, Any]:
        path, offset, size = self.where[i]
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        label = None if self.labels is None else int(self.labels[i])
        return {"image": data, "txt": f"{path}#{i}", "key": f"{path}#{i}", "label": label}


# ------------------------------------------------------------------------------ the sets
def demo(split: str, demo_kwargs: Mapping[str, Any] | None = None, task: str | None = None
         ) -> EvalSet:
    """A demo split ("zeroshot", "retrieval", "levels"), with its tokenizer in info.

    zeroshot: label = the task's label_key, info classnames / templates of `task` ("object" |
    "shape"). retrieval: one caption per record. levels: the 4 caption levels of each record."""
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
    es = EvalSet(task if split == "zeroshot" else "demo", Records(n, reader), info=info)
    if split != "zeroshot":
        txt = [reader.header(i)["txt"] for i in range(n)]
        per = [[t] if isinstance(t, str) else list(t) for t in txt]
        es.captions = [c for p in per for c in p]
        es.caption_record = np.repeat(np.arange(n), [len(p) for p in per])
        es.info["captions_per_record"] = len(per[0]) if per else 1
    return es


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
    return EvalSet(name, Records(n, Files(files, labels)),
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
        import tensorflow_datasets as tfds  # optional heavy dependency: imported where used
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
    reader = Tfds(src, label_key="label", label_map=label_map)
    return EvalSet(name, Records(n, reader), info=info)


def arrays(images: np.ndarray, name: str) -> EvalSet:
    """uint8 images [N, H, W, 3] held in memory (e.g. an .npz analysis set)."""
    return EvalSet(name, Records(len(images), _Arrays(images)))
