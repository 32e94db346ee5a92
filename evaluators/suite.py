"""DataComp's 38-task zero-shot suite (paper §4.1 "Evaluation", Table 1, appendix B.3 / C.1).

The task list is evaluators/data/datacomp38.json (DataComp `tasklist.yml`: the 38 tasks with a
main metric; see evaluators/data/README.md): per task its DataComp key, group (imagenet,
dist_shift, vtab, retrieval, other -- the paper's Table 1 columns), main metric, shipped class
names and templates, and where its data may come from. For each task the first source found
under `data_dir` is used:

    wds          DIR/wds_<datacomp key with / -> ->_test/   (DataComp's download_evalsets.py /
                 clip_benchmark webdataset layout; its classnames.txt and templates win, as in
                 DataComp, over the shipped ones)
    imagefolder  DIR/<task id>/<split>/<class dir>/*.jpg    (split "test"; class dirs are
                 ImageNet wnids for the ImageNet family, else class names, else matched to the
                 class list in sorted order; DIR/<task id>/classnames.txt overrides the shipped
                 names, e.g. for ObjectNet)
    karpathy     retrieval only: DIR/flickr30k/dataset_flickr30k.json + DIR/flickr30k/images,
                 DIR/mscoco/dataset_coco.json + DIR/mscoco (the retrieval evaluator's loader)
    tfds         tfds.data_source(name, split) under `tfds_data_dir` (optional extra)

A task without data, class names, or with labels outside its class list is skipped with one
line saying why; nothing is ever scored 0 for lack of data. Classification scores the prompt
ensemble with CSD ("csd", the paper's protocol: appendix B.3), or mu.mu for a deterministic
model. Main metrics (DataComp tasklist `main_metric`, default acc1), all in % (0-100; DataComp
writes fractions: divide by 100 to compare):
acc1, mean_per_class_recall, f1_macro, worst_group_acc, worst_group_top5 (WILDS / fairness
metadata from the webdataset's .npy), mean_recall@1 (retrieval: (i2t R@1 + t2i R@1) / 2).

Config: `Config` (data_dir required; tasks, split, score, encoding knobs, tokenizer).
Metrics: suite/<task>/<metric>, suite/<group>/average, suite/average, suite/num_tasks.
`rows` holds the table of the last run; `write_tables(rows, out)` writes suite.json + suite.md.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import jax
import numpy as np

from evaluators import common, retrieval, retrieval_data, zeroshot as zs
from input_pipeline import eval_data
from input_pipeline.eval_data import EvalSet, Records, TarImages

DATA_DIR = Path(__file__).parent / "data"
GROUPS = ("imagenet", "dist_shift", "vtab", "retrieval", "other")


@dataclasses.dataclass(frozen=True)
class Config:
    """The suite's knobs: config.evals.<name> with type="datacomp38"."""
    data_dir: str = ""               # required: the folder holding the tasks' data (module doc)
    tfds_data_dir: str = ""          # tfds data_dir, an optional source ("" = not looked for)
    tasks: tuple[str, ...] = ()      # task ids of datacomp38.json; () = all 38
    split: str = "test"              # the split folder of wds / imagefolder sources
    score: Literal["csd", "dot"] = "csd"   # -CSD (the paper's protocol) or mu.mu; a deterministic
    #                                  model is scored by mu.mu whatever this says
    image_size: int | None = None    # None: the model's vision.image_size
    batch_size: int = 256            # images per batch, per host
    num_threads: int = 8             # image reading threads per host
    normalization: str = "openai"    # image normalisation of the encoder
    tokenizer: dict = dataclasses.field(default_factory=dict)  # kwargs of build_tokenizer (kind,
    #                                  path, ...), when no tokenizer is passed in

    def validate(self) -> None:
        if not self.data_dir:
            raise ValueError("the datacomp38 suite needs config.data_dir")


class Skip(Exception):
    """A task that cannot run here; str(e) is the one-line reason."""


# ----------------------------------------------------------------------------- shipped data
def _json(name: str) -> Any:
    with open(DATA_DIR / name) as f:
        return json.load(f)


def load_tasks(ids: Sequence[str] | None = None) -> list[dict]:
    """The 38 task entries (datacomp38.json), or those named by `ids` (in the table's order)."""
    tasks = _json("datacomp38.json")["tasks"]
    if ids:
        unknown = sorted(set(ids) - {t["id"] for t in tasks})
        if unknown:
            raise ValueError(f"unknown suite tasks {unknown}; known: {[t['id'] for t in tasks]}")
        tasks = [t for t in tasks if t["id"] in set(ids)]
    return tasks


def imagenet_wnids(subset: str = "imagenet1k") -> list[str]:
    """Sorted wnids of ImageNet-1k or of a 200-class subset (imagenet-a / -r / -o)."""
    return _json("imagenet_wnids.json")[subset]


def shipped_classnames(ref: str | None) -> list[str] | None:
    """"imagenet1k", an ImageNet subset (its names in ImageNet order, as clip_benchmark masks
    them), or "<project>:<key>" of datacomp_classnames.json; None if nothing is shipped."""
    if not ref:
        return None
    if ref == "imagenet1k" or ref.startswith("imagenet-"):
        names = zs.imagenet_classnames()
        if ref == "imagenet1k":
            return names
        keep = set(imagenet_wnids(ref))
        return [n for n, w in zip(names, imagenet_wnids()) if w in keep]
    project, _, key = ref.partition(":")
    return list(_json("datacomp_classnames.json")[project][key])


def shipped_templates(ref: str | None) -> list[str] | None:
    """The 80 OpenAI ImageNet templates ("imagenet1k", clip_benchmark's default) or a key of
    datacomp_templates.json (clip_benchmark's `{c}` written as `{}`)."""
    if not ref or ref == "imagenet1k":
        return zs.openai_imagenet_templates()
    return [t.replace("{c}", "{}") for t in _json("datacomp_templates.json")[ref]]


def wds_folder(task: dict) -> str:
    """DataComp's folder name for a task: wds_<key with '/' -> '-'>_test."""
    return f"wds_{task['datacomp_key'].replace('/', '-')}_test"


# ----------------------------------------------------------------------------- clip_benchmark webdatasets
WDS_IMAGE_EXTS = ("webp", "png", "jpg", "jpeg")   # clip_benchmark build_wds_dataset's order


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
    """The non-empty lines of a text file, stripped; None when it does not exist."""
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
        return EvalSet(name, Records(len(rows), TarImages(where, None)), [c for p in per for c in p],
                       np.repeat(np.arange(len(rows)), [len(p) for p in per]), info)
    if any("cls" not in s for s in rows):
        raise ValueError(f"webdataset {folder!r}: some samples have no .cls label")
    labels = np.asarray([int(s["cls"].decode().strip()) for s in rows], np.int64)
    info["labels"] = labels
    if all("npy" in s for s in rows):
        info["metadata"] = np.stack([np.load(io.BytesIO(s["npy"])) for s in rows])
    return EvalSet(name, Records(len(rows), TarImages(where, labels)), info=info)


# ----------------------------------------------------------------------------- sources
def _norm(s: str) -> str:
    return re.sub(r"[\s_]+", " ", s.strip().lower())


def _imagefolder_index(task: dict, base: str, classnames: list[str]) -> dict[str, int]:
    """class dir -> label: ImageNet wnids, else class names, else sorted order (same count)."""
    dirs = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if task.get("class_dirs"):
        wnids = imagenet_wnids(task["class_dirs"])
        index = {w: i for i, w in enumerate(wnids)}
        extra = [d for d in dirs if d not in index]
        if extra:
            raise Skip(f"label set mismatch: class folders {extra[:3]} of {base} are not "
                       f"{task['class_dirs']} wnids")
        return index
    by_name = {_norm(c): i for i, c in enumerate(classnames)}
    if dirs and all(_norm(d) in by_name for d in dirs):
        return {d: by_name[_norm(d)] for d in dirs}
    if len(dirs) != len(classnames):
        raise Skip(f"label set mismatch: {len(dirs)} class folders under {base} but "
                   f"{len(classnames)} class names")
    return {d: i for i, d in enumerate(dirs)}   # torchvision ImageFolder order


def _class_lists(task: dict, folder: str | None, es: EvalSet | None
                 ) -> tuple[list[str], list[str]]:
    """(class names, templates): the data's own files first (DataComp uses a webdataset's
    classnames.txt / templates), then the shipped ones."""
    info = es.info if es is not None else {}
    names = info.get("classnames")
    templates = info.get("templates")
    if folder is not None:
        names = names or read_lines(os.path.join(folder, "classnames.txt"))
        local = read_lines(os.path.join(folder, "templates.txt"))
        templates = templates or (None if local is None else [t.replace("{c}", "{}") for t in local])
    names = names or shipped_classnames(task.get("classnames"))
    if not names:
        where = f"{folder}/classnames.txt" if folder else "the data"
        raise Skip(f"missing class-name file: nothing shipped for {task['id']} and no {where}")
    return list(names), list(templates or shipped_templates(task.get("templates")))


def open_classification(task: dict, data_dir: str, split: str = "test",
                        tfds_data_dir: str = "") -> tuple[str, EvalSet, list[str], list[str]]:
    """(source kind, image set, class names, templates) of the first source present; Skip."""
    wds = os.path.join(data_dir, wds_folder(task))
    if os.path.isdir(wds):
        es = webdataset(wds, split, task["id"])
        names, templates = _class_lists(task, None, es)
        return "wds", es, names, templates
    folder = os.path.join(data_dir, task["id"])
    if os.path.isdir(os.path.join(folder, split)):
        names, templates = _class_lists(task, folder, None)
        index = _imagefolder_index(task, os.path.join(folder, split), names)
        return "imagefolder", eval_data.imagefolder(folder, split, index, task["id"]), names, templates
    looked = [wds, os.path.join(folder, split)]
    if task.get("tfds") and tfds_data_dir:
        return _open_tfds(task, tfds_data_dir)
    if task.get("tfds"):
        looked.append(f"tfds {task['tfds']['name']} (no tfds_data_dir given)")
    raise Skip("no data: looked for " + ", ".join(looked))


def _open_tfds(task: dict, data_dir: str) -> tuple[str, EvalSet, list[str], list[str]]:
    t = task["tfds"]
    label_map = None
    if t.get("labels") == "imagenet1k":   # tfds imagenet_a / _r label with ImageNet-1k indices
        sub = {w: i for i, w in enumerate(imagenet_wnids(task["class_dirs"]))}
        label_map = [sub.get(w, -1) for w in imagenet_wnids()]
    try:
        es = eval_data.tfds_classification(t["name"], t["split"], data_dir, task["id"],
                                           label_map=label_map)
    except (ImportError, FileNotFoundError) as e:
        raise Skip(f"missing tfds data: {e}".splitlines()[0]) from e
    names, templates = _class_lists(task, None, None)
    n = es.info.get("num_classes")
    if n is not None and label_map is None and n != len(names):
        raise Skip(f"label set mismatch: tfds {t['name']} has {n} classes but {len(names)} class names")
    return "tfds", es, names, templates


# ----------------------------------------------------------------------------- metrics
def classification_metrics(task: dict, pred: np.ndarray, rank: np.ndarray, labels: np.ndarray,
                           metadata: np.ndarray | None) -> dict[str, float]:
    """The task's main metric (key "main") and acc1, acc5, mean_per_class_recall."""
    out = {"acc1": common.percent(np.mean(rank < 1)), "acc5": common.percent(np.mean(rank < 5)),
           "mean_per_class_recall": zs.mean_per_class_recall(pred, labels)}
    metric = task["metric"]
    if metric == "f1_macro":
        out[metric] = zs.macro_f1(pred, labels)
    elif metric.startswith("worst_group"):
        if metadata is None:
            raise Skip(f"{metric} needs group metadata (.npy per sample in the webdataset)")
        correct = rank < (5 if metric.endswith("top5") else 1)
        out[metric] = zs.worst_group_accuracy(correct, metadata[:, task["group_column"]],
                                              task.get("exclude_groups", ()))
    out["main"] = out[metric]
    return out


def retrieval_metric(metrics: dict[str, float], score: str) -> float:
    """DataComp's mean_recall@1 = (i2t R@1 + t2i R@1) / 2, in % as the retrieval evaluator
    reports R@1 (COCO's full-set numbers are its .../5k/... ones)."""
    def find(d: str) -> float:
        pat = re.compile(rf"^retrieval/[^/]+/{score}(/5k)?/{d}_R@1$")
        hits = [v for k, v in metrics.items() if pat.match(k)]
        if not hits:
            raise ValueError(f"the retrieval evaluator gave no {score} {d}_R@1")
        return hits[0]
    return (find("i2t") + find("t2i")) / 2.0


def averages(rows: list[dict]) -> dict[str, Any]:
    """Mean main metric over the tasks that ran, overall and per group, with the counts."""
    ran = [r for r in rows if r.get("value") is not None]
    out: dict[str, Any] = {"average": float(np.mean([r["value"] for r in ran])) if ran else None,
                           "num_tasks": len(ran), "num_skipped": len(rows) - len(ran)}
    for g in GROUPS:
        vals = [r["value"] for r in ran if r["group"] == g]
        out[f"{g}/average"] = float(np.mean(vals)) if vals else None
        out[f"{g}/num_tasks"] = len(vals)
    return out


# ----------------------------------------------------------------------------- the evaluator
class Evaluator:
    """DataComp 38-task suite (see the module docstring); registered as "datacomp38"."""
    HEADLINE = (r"suite/average$",)  # the metrics the trainer's console line shows (regexes)

    def __init__(self, config: Any, model: Any, tokenizer: Callable | None = None):
        self.config = c = common.parse_config(Config, config, "datacomp38")
        self.model = model
        self.data_dir = c.data_dir
        self.tasks = load_tasks(c.tasks)
        self.split = c.split
        self.tfds_data_dir = c.tfds_data_dir
        self.score = c.score
        self.image_size = int(c.image_size or model.config.vision.image_size)
        self.threads = c.num_threads
        self.encoder = common.Encoder(model, c.batch_size, c.normalization)
        self.tokenizer = tokenizer or common.tokenizer_from(
            c.tokenizer, model.config.text.context_length, "datacomp38 suite")
        self.rows: list[dict] = []

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]:
        self.rows = []
        for task in self.tasks:
            row = {k: task[k] for k in ("id", "name", "group", "metric")}
            try:
                row.update(self._run_task(task, params, progress))
                print(f"suite: {task['id']}: {task['metric']} {row['value']:.2f}% "
                      f"({row['n']} images, {row['source']})", file=sys.stderr)
                yield f"suite/{task['id']}/{task['metric']}", row["value"]
            except Skip as e:
                row.update(value=None, skipped=str(e))
                print(f"suite: {task['id']}: skipped: {e}", file=sys.stderr)
            self.rows.append(row)
        for k, v in averages(self.rows).items():
            if v is not None:
                yield f"suite/{k}", float(v)

    def _run_task(self, task: dict, params: Any, progress: Callable | None) -> dict:
        if task["kind"] == "unsupported":
            raise Skip(task["reason"])
        if task["kind"] == "retrieval":
            return self._retrieval(task, params, progress)
        source, es, names, templates = open_classification(task, self.data_dir, self.split,
                                                           self.tfds_data_dir)
        tokens = common.tokenize_checked(self.tokenizer, zs.prompts(names, templates),
                                         f"{task.get('id', 'zero-shot')} prompts")
        text_mu, text_lv = self.encoder.texts(params, tokens)
        batches = es.batches(self.encoder.batch_size * jax.process_count(), self.image_size,
                             self.encoder.normalization, self.threads)
        img = self.encoder.dataset(params, batches, len(es), progress, fields=("label",))
        labels = img["label"].astype(np.int64)
        if labels.size and (labels.min() < 0 or labels.max() >= len(names)):
            raise Skip(f"label set mismatch: labels span {labels.min()}..{labels.max()} but "
                       f"there are {len(names)} class names ({source})")
        probabilistic = text_lv is not None and img.get("logvar") is not None
        kind = self.score if probabilistic else "dot"
        cmu, cs2 = zs.class_embeddings(text_mu, text_lv if probabilistic else np.zeros_like(text_mu),
                                       len(names), len(templates))
        rank = zs.ranks(img["mu"], labels, cmu, cs2, kind)
        pred = zs.predictions(img["mu"], cmu, cs2, kind)
        m = classification_metrics(task, pred, rank, labels, es.info.get("metadata"))
        return dict(value=m.pop("main"), n=len(labels), source=source, score=kind,
                    num_classes=len(names), num_templates=len(templates), metrics=m)

    def _retrieval(self, task: dict, params: Any, progress: Callable | None) -> dict:
        cfg = dict(name=task["id"], scores=(self.score,), batch_size=self.encoder.batch_size,
                   num_threads=self.threads, image_size=self.image_size, eccv=False,
                   unc_bins=0, same_modality=(), num_folds=0,
                   normalization=self.encoder.normalization)
        wds = os.path.join(self.data_dir, wds_folder(task))
        kp = task["karpathy"]
        js, images = (os.path.join(self.data_dir, kp[k]) for k in ("json", "images"))
        if os.path.isdir(wds):
            source, es = "wds", webdataset(wds, self.split, task["id"])
        elif os.path.exists(js):
            source, es = "karpathy", retrieval_data.karpathy(js, images, self.split)
            es.name = task["id"]
        else:
            raise Skip(f"no data: looked for {wds}, {js}")
        if not es.captions:
            raise Skip(f"{source} data of {task['id']} has no captions")
        ev = retrieval.Evaluator(cfg, self.model, self.tokenizer, data=es)
        ev.encoder = self.encoder
        metrics = dict(ev.run(params, progress))
        score = self.score if any(f"/{self.score}/" in k for k in metrics) else "dot"
        return dict(value=retrieval_metric(metrics, score), n=len(es), source=source,
                    score=score, metrics={k: v for k, v in metrics.items() if "R@1" in k})


# ----------------------------------------------------------------------------- the tables
def write_tables(rows: list[dict], out: str | os.PathLike, extra: dict | None = None) -> None:
    """out/suite.json ({"tasks": rows, "summary": averages, **extra}) and out/suite.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = averages(rows)
    with open(out / "suite.json", "w") as f:
        json.dump({"suite": "datacomp38", "tasks": rows, "summary": summary, **(extra or {})},
                  f, indent=1)
    lines = ["| task | group | metric | value | n images |", "|---|---|---|---|---|"]
    for r in rows:
        if r.get("value") is None:
            lines.append(f"| {r['name']} | {r['group']} | {r['metric']} | skipped: "
                         f"{r['skipped'].replace('|', '/')} | |")
        else:
            lines.append(f"| {r['name']} | {r['group']} | {r['metric']} | {r['value']:.2f} "
                         f"| {r['n']} |")
    lines.append("")
    avg = summary["average"]
    lines.append(f"Average over {summary['num_tasks']} of {len(rows)} tasks: "
                 + ("none ran" if avg is None else f"{avg:.2f}"))
    for g in GROUPS:
        a = summary[f"{g}/average"]
        if a is not None:
            lines.append(f"- {g}: {a:.2f} ({summary[f'{g}/num_tasks']} tasks)")
    (out / "suite.md").write_text("\n".join(lines) + "\n")
