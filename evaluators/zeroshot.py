"""Zero-shot classification (paper §4.2; naver-ai/prolip src/prolip/zero_shot_classifier.py, §3.2).

Class embedding = prompt ensemble: the mean over templates of the normalised text mu,
re-normalised, and the mean over templates of sigma^2 (not normalised). Two scores:
    dot   100 * mu_img . mu_c                              (the reference's training-time eval)
    csd   100 * mu_img . mu_c - 50 * sum_d sigma2_{c,d}    (naver-ai/prolip src/prolip/zero_shot_classifier.py `unc_logits`; for unit
          mu_c this ranks classes exactly like -CSD, whose image terms are constant per row)
Also the top-1 accuracy in 10 equal-count bins of image uncertainty sum_d sigma2_d and its
correlation with the bin index (naver-ai/prolip src/prolip/zero_shot_classifier.py `eval_clsf_unc`), and optionally BPRW
(evaluators/prompt_reweighting.py).

Config: the fields of `Config` below (dataset "demo" | "imagefolder" | "tfds", class names and
templates, BPRW and prompt-selection settings, encoding knobs).
Metrics (all accuracies in %, 0-100; docs/metrics.md):
    zeroshot/<name>/top1_dot, top5_dot, top1_csd, top5_csd
    zeroshot/<name>/unc_bin{0..9}_top1_dot, unc_bin{i}_top1_csd   (bin 0 = least uncertain)
    zeroshot/<name>/unc_corr_dot, unc_corr_csd   (Pearson r of bin index vs accuracy, in [-1, 1])
    zeroshot/<name>/image_sigma2_trace_mean, text_sigma2_trace_mean   (mean tr(Sigma) of the images,
    of the prompts)
    bprw/<name>/<mode>/top1_{dot,csd}_base (80-prompt ensemble), top1_{dot,csd} (re-weighted),
    bprw/<name>/<mode>/weight_max, weight_entropy, em_iterations   (<mode>: "nn", "fewshot", or
    the spec string for other settings)
    promptsel/<name>/<label>/top1_{dot,csd}_base (all templates), top1_{dot,csd} (selected),
    promptsel/<name>/<label>/kept_mean, kept_min   (templates kept per class; <label>: e.g.
    "sigma_filter_0", "topk_10")
A deterministic model (log sigma^2 None) yields top1_dot and top5_dot only; BPRW needs sigma^2.
`BPRWEvaluator` (registered as "prompt_reweighting") yields only the bprw/... metrics.
Images are read through input_pipeline.eval_data (sharded over the hosts); labels ride along.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import jax
import numpy as np

from evaluators import common, prompt_reweighting, prompt_selection
from input_pipeline import eval_data
from input_pipeline.caption_files import read_list as _read_list

DATA_DIR = Path(__file__).parent / "data"

Settings = str | dict | tuple[str | dict, ...]   # one setting, or several


@dataclasses.dataclass(frozen=True)
class Config:
    """The zero-shot evaluator's knobs: config.evals.<name> with type="zeroshot" (or
    "prompt_reweighting", which sets bprw_only and defaults bprw to ("nn", "fewshot"))."""
    # --- the image set
    dataset: Literal["demo", "imagefolder", "tfds"] = "demo"   # which reader (`eval_set`)
    demo: dict = dataclasses.field(default_factory=dict)  # demo: kwargs of input_pipeline.demo.get_demo
    task: str = "object"             # demo task: "object" (36 colour x shape classes) or "shape"
    root: str = ""                   # imagefolder: images at <root>/<split>/<class_dir>/*.JPEG
    split: str = "val"               # imagefolder: the split folder
    # imagefolder: label order, JSON {class_dir: index} | JSON [class_dir, ...] | Keras-style JSON
    # {"0": [class_dir, name]} | text file, one class_dir per line | a mapping or list; "" = the
    # sorted class dirs (the torchvision convention)
    class_index: str | tuple[str, ...] | dict = ""
    tfds_split: str = "validation"   # tfds: tfds.data_source("imagenet2012", split)
    data_dir: str = ""               # tfds: its data_dir ("" = tfds' default)
    num_images: int = 0              # use only the first N images (0 = all)
    # --- classes and prompts
    name: str | None = None          # task name in the metric names; None: the demo task, the
    #                                  ImageFolder root's name ("imagenet" for ImageNet), else "imagenet"
    # lists, or paths to a JSON list / text file (one per line); None or empty: the demo task's,
    # else the 1,000 ImageNet names / 80 OpenAI templates. imagefolder: class names default to the
    # folder names ("_" -> " ") and are checked against the folders (`imagefolder_classnames`); a
    # {folder: name} mapping (or JSON object file) works too
    classnames: str | tuple[str, ...] | dict | None = None
    templates: str | tuple[str, ...] | None = None
    tokenizer: dict = dataclasses.field(default_factory=dict)  # kwargs of build_tokenizer (kind,
    #                                  path, ...), used when no tokenizer is passed in
    # --- encoding
    image_size: int | None = None    # None: the model's vision.image_size
    normalization: str = "openai"    # image normalisation of the encoder
    batch_size: int = 256            # images per batch, per host
    num_threads: int = 8             # image reading threads per host
    # --- BPRW (evaluators/prompt_reweighting.py) and prompt selection (prompt_selection.py)
    # BPRW settings: "nn", "fewshot", a spec 'alpha-multiplier-NN-K-stable_eps-prior' or a dict of
    # BPRWConfig fields (+ spec); None: off (("nn", "fewshot") for type="prompt_reweighting")
    bprw: Settings | None = None
    bprw_seed: int = 0               # seeds the few-shot picks and the EM samples
    bprw_exclude_support: bool = False   # few-shot accuracies without the support images
    bprw_only: bool = False          # yield only the bprw/... metrics (type="prompt_reweighting")
    out_dir: str = ""                # where BPRW weights go (bprw_<name>_<mode>.npy/.json); "" = nowhere
    # uncertainty-based prompt selections (paper Table 3), e.g. [dict(kind="sigma_filter",
    # coeff=0.0), dict(kind="topk", k=10)] or "topk:10"; () = none
    prompt_select: Settings = ()

    def validate(self) -> None:
        if self.dataset == "imagefolder" and not self.root:
            raise ValueError("zero-shot evaluator: dataset='imagefolder' needs config.root")
        for setting in _settings(self.bprw or ()):
            prompt_reweighting.parse_config(setting)   # a bad setting fails before any encoding
        for setting in _settings(self.prompt_select):
            prompt_selection.parse(setting)


def _settings(value: Settings) -> list:
    """One setting (a string or a dict) or several -> a list of settings."""
    return [value] if isinstance(value, (str, dict)) else list(value)


def imagenet_classnames() -> list[str]:
    """The 1,000 open_clip / OpenAI ImageNet class names, in class-index order."""
    return _read_list(str(DATA_DIR / "imagenet_classnames.json"), "class names")


def openai_imagenet_templates() -> list[str]:
    """The 80 OpenAI ImageNet prompt templates as format strings with one `{}`."""
    return _read_list(str(DATA_DIR / "openai_imagenet_templates.json"), "templates")


def resolve_list(value: Any, default: Callable[[], list[str]], what: str) -> list[str]:
    """A list as given, a path to a JSON list / text file, or the default when empty."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return default()
    if isinstance(value, str):
        return _read_list(value, what)
    return [str(x) for x in value]


def prompts(classnames: Sequence[str], templates: Sequence[str]) -> list[str]:
    """Class-major prompt list [C * T]: prompt c * T + t = templates[t].format(classnames[c])."""
    return [t.format(c) for c in classnames for t in templates]


# ----------------------------------------------------------------------------- pure functions
def class_embeddings(text_mu: np.ndarray, text_logvar: np.ndarray, n_classes: int,
                     n_templates: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ensemble (naver-ai/prolip src/prolip/zero_shot_classifier.py; paper §4.2).

    text_mu [C*T, D] (unit norm), text_logvar [C*T, D], class-major (see `prompts`) ->
    (class mu [C, D] = normalise(mean_t mu_{c,t}), class sigma^2 [C, D] = mean_t exp(logvar)).
    """
    mu = np.asarray(text_mu, np.float64).reshape(n_classes, n_templates, -1).mean(1)
    mu /= np.maximum(np.linalg.norm(mu, axis=-1, keepdims=True), 1e-12)
    sigma2 = np.exp(np.asarray(text_logvar, np.float64)).reshape(n_classes, n_templates, -1).mean(1)
    return mu, sigma2


def zeroshot_logits(image_mu: np.ndarray, class_mu: np.ndarray,
                    class_sigma2: np.ndarray | None = None, kind: str = "dot") -> np.ndarray:
    """image_mu [N, D], class_mu [C, D], class_sigma2 [C, D] -> logits [N, C].

    "dot": 100 mu_img . mu_c; "csd": 100 mu_img . mu_c - 50 sum_d sigma2_c (naver-ai/prolip src/prolip/zero_shot_classifier.py).
    """
    logits = 100.0 * np.asarray(image_mu, np.float64) @ np.asarray(class_mu, np.float64).T
    if kind == "dot":
        return logits
    if kind != "csd":
        raise ValueError(f"unknown score kind {kind!r}; use 'dot' or 'csd'")
    if class_sigma2 is None:
        raise ValueError("csd scores need the class sigma^2")
    return logits - 50.0 * np.sum(class_sigma2, -1)[None, :]


def label_rank(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Rank [N] of the true class in each row (0 = top), ties broken towards the lower class
    index as a stable sort of -logits would (so a constant classifier is not rewarded)."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    true = logits[np.arange(len(labels)), labels][:, None]
    cls = np.arange(logits.shape[1])[None, :]
    return np.sum((logits > true) | ((logits == true) & (cls < labels[:, None])), 1)


def topk_correct(logits: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """bool [N]: the true label is among the k highest logits."""
    return label_rank(logits, labels) < k


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
    """% of rows whose true label is among the k highest logits [N, C]."""
    return common.percent(np.mean(topk_correct(logits, labels, k)))


# Metrics of DataComp's suite (evaluators/suite.py): `pred` = top-1 class, `labels` = truth.
def mean_per_class_recall(pred: np.ndarray, labels: np.ndarray) -> float:
    """Mean over the classes present in `labels` of the % of their images predicted right
    (sklearn balanced_accuracy_score, as DataComp's eval_utils/wds_eval.py computes it, x 100)."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    return common.percent(np.mean([np.mean(pred[labels == c] == c) for c in np.unique(labels)]))


def macro_f1(pred: np.ndarray, labels: np.ndarray) -> float:
    """Mean F1 (%) over the classes present in `labels` (WILDS F1(average="macro"), DataComp's
    iWildCam "F1-macro_all", x 100); a class never predicted has precision 0, and F1 0 if p + r = 0."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    f1 = []
    for c in np.unique(labels):
        tp = np.sum((pred == c) & (labels == c))
        p = tp / max(1, np.sum(pred == c))
        r = tp / np.sum(labels == c)
        f1.append(0.0 if p + r == 0 else 2 * p * r / (p + r))
    return common.percent(np.mean(f1))


def worst_group_accuracy(correct: np.ndarray, groups: np.ndarray, exclude: Sequence[int] = ()
                         ) -> float:
    """Lowest mean of `correct` (in %) over the groups that have items, `exclude`d groups left out
    (WILDS worst-group metrics: DataComp's FMoW acc_worst_region without "Other", GeoDE
    acc_wg, Dollar Street acc_top5_wg with top-5 `correct`)."""
    correct, groups = np.asarray(correct, np.float64), np.asarray(groups)
    keep = [g for g in np.unique(groups) if g not in set(exclude)]
    if not keep:
        raise ValueError("worst_group_accuracy: no group left")
    return common.percent(min(np.mean(correct[groups == g]) for g in keep))


def predictions(image_mu: np.ndarray, class_mu: np.ndarray, class_sigma2: np.ndarray,
                kind: str, block: int = 4096) -> np.ndarray:
    """Top-1 class [N] (the lowest index among ties, as np.argmax), in image blocks."""
    return np.concatenate([
        np.argmax(zeroshot_logits(image_mu[s:s + block], class_mu, class_sigma2, kind), 1)
        for s in range(0, len(image_mu), block)] or [np.zeros(0, int)])


def ranks(image_mu: np.ndarray, labels: np.ndarray, class_mu: np.ndarray,
          class_sigma2: np.ndarray, kind: str, block: int = 4096) -> np.ndarray:
    """True-label rank [N] in image blocks, so N x C logits never sit in memory at once."""
    return np.concatenate([
        label_rank(zeroshot_logits(image_mu[s:s + block], class_mu, class_sigma2, kind),
                   labels[s:s + block]) for s in range(0, len(image_mu), block)] or [np.zeros(0, int)])


def topk_accuracy_ranked(image_mu: np.ndarray, labels: np.ndarray, class_mu: np.ndarray,
                         class_sigma2: np.ndarray, kind: str, k: int = 1) -> float:
    """Top-k accuracy (%) from `ranks` (image blocks)."""
    return common.percent(np.mean(ranks(image_mu, labels, class_mu, class_sigma2, kind) < k))


# ----------------------------------------------------------------------------- data
def eval_set(config: Config) -> eval_data.EvalSet:
    """The image set of a zero-shot config (labels ride in the eval batches)."""
    kind, limit = config.dataset, config.num_images
    if kind == "demo":
        es = eval_data.demo("zeroshot", config.demo, config.task)
        if limit:
            es.records.n = min(limit, es.records.n)
        return es
    if kind == "imagefolder":
        return eval_data.imagefolder(config.root, config.split, config.class_index, limit=limit)
    return eval_data.tfds_classification("imagenet2012", config.tfds_split, config.data_dir or None,
                                         limit=limit)


def imagenet_wnids() -> list[str]:
    """The 1,000 ImageNet-1k wnids, sorted (= the class-index order of imagenet_classnames)."""
    with open(DATA_DIR / "imagenet_wnids.json") as f:
        return list(json.load(f)["imagenet1k"])


def _norm_name(s: str) -> str:
    return " ".join(str(s).replace("_", " ").lower().split())


def _short(names: Sequence[str], n: int = 8) -> str:
    names = list(names)
    return repr(names[:n])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > n else "]")


def _given_classnames(value: Any) -> list[str] | dict[str, str] | None:
    """config.classnames as given: None (empty), a list, or a {class_dir: name} mapping (a
    mapping, or a path to a JSON object file; a path to a JSON list / text file is a list)."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return None
    if hasattr(value, "items"):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, str) and value.endswith(".json") and Path(value).is_file():
        raw = json.loads(Path(value).read_text())
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items()}
    return resolve_list(value, list, "class names")


def imagefolder_classnames(info: dict[str, Any], classnames: Any) -> list[str]:
    """The class names of an ImageFolder set in label order, checked against its folders.

    Labels follow the sorted folder names (or the config's class_index), so a name list is only
    right if it is in that order; a wrong order scores below chance without any other sign.
      * no classnames: the folder names ("_" -> " "); ImageNet's names only when the folders
        are ImageNet wnids (each folder gets its wnid's name);
      * a {class_dir: name} mapping: must name every folder;
      * a list with class_index: one name per label;
      * a list without class_index: must be the folder names in sorted order ("_" = " ",
        case ignored) -- another order, or names that differ from the folders, is an error
        that says what differs and how to give the mapping (the 1,000 ImageNet names on the
        ImageNet folders are the one exception: their order is the standard one).
    """
    dirs, index, where = info["class_dirs"], info["class_index"], info["where"]
    names = _given_classnames(classnames)
    n_labels = max(index.values()) + 1 if index else 0
    fix = ("give class_index: the class folders in the order of your class names (a text file, "
           "one folder per line, or a list), or give classnames as {folder: name} (a mapping or "
           "a JSON object file)")

    def by_label(name_of: dict[str, str]) -> list[str]:
        out: list[str | None] = [None] * n_labels
        for d, label in index.items():
            if d in name_of:
                out[label] = name_of[d]
        gaps = [i for i, n in enumerate(out) if n is None]
        if gaps:
            raise ValueError(f"zero-shot on {where}: labels {gaps[:8]} have no class name "
                             "(class_index skips them)")
        return out

    wnids = imagenet_wnids()
    is_imagenet = set(dirs) == set(wnids)
    if names is None:
        if dirs and set(dirs) <= set(wnids):   # ImageNet or a subset of it: names by wnid
            imagenet = dict(zip(wnids, imagenet_classnames()))
            return by_label({d: imagenet[d] for d in index if d in imagenet})
        return by_label({d: d.replace("_", " ") for d in index})
    if isinstance(names, dict):
        missing = [d for d in dirs if d not in names]
        if missing:
            raise ValueError(f"zero-shot on {where}: classnames (a {{folder: name}} mapping) names "
                             f"no class for the folders {_short(missing)}")
        return by_label({d: names.get(d, d.replace("_", " ")) for d in index})
    if info.get("class_index_given"):
        if len(names) != n_labels:
            raise ValueError(f"zero-shot on {where}: {len(names)} class names but class_index "
                             f"has {n_labels} labels")
        return names
    want, got = [_norm_name(d) for d in dirs], [_norm_name(n) for n in names]
    if got == want:
        return names
    if sorted(got) == sorted(want):
        wrong = sum(a != b for a, b in zip(got, want))
        raise ValueError(
            f"zero-shot on {where}: classnames are the class folders in another order ({wrong} "
            f"of {len(want)} out of place): images are labelled by sorted folder name "
            f"{_short(dirs)}, so most classes would be scored against another class's name; "
            "list classnames in sorted folder order, or set class_index to the folders in your "
            "order (class_index=classnames does it)")
    if is_imagenet and len(names) == len(wnids):
        return names   # the standard ImageNet class order is the sorted-wnid order
    missing = [d for d, w in zip(dirs, want) if w not in set(got)]
    extra = [n for n, g in zip(names, got) if g not in set(want)]
    if len(missing) == len(dirs) and len(names) == len(dirs):
        raise ValueError(
            f"zero-shot on {where}: the class names {_short(names)} match none of the class "
            f"folders {_short(dirs)}; images are labelled by sorted folder name, so which name "
            f"goes with which folder would be a guess: {fix}")
    raise ValueError(
        f"zero-shot on {where}: classnames do not match the class folders: folders without a "
        f"class name {_short(missing)}, class names without a folder {_short(extra)} "
        f"({len(dirs)} folders, {len(names)} names); leave classnames empty to use the folder "
        f"names, or {fix}")


# ----------------------------------------------------------------------------- the evaluator
class Evaluator:
    """Zero-shot classification of one image set (`Config`; metrics in the module docstring)."""
    KIND = "zeroshot"
    HEADLINE = (r"/top1_[a-z]+$",)  # the metrics the trainer's console line shows (regexes)

    def __init__(self, config: Any, model: Any, tokenizer: Callable[[Sequence[str]], np.ndarray] | None = None):
        self.config = c = self.parse(config)
        self.model = model
        self.image_size = int(c.image_size or model.config.vision.image_size)
        self.data = eval_set(c)
        info = self.data.info
        if "class_dirs" in info:   # an ImageFolder: names checked against the folders
            self.classnames = imagefolder_classnames(info, c.classnames)
            default_name = ("imagenet" if set(info["class_dirs"]) == set(imagenet_wnids())
                            else Path(c.root).name or "imagefolder")
        else:
            self.classnames = resolve_list(c.classnames,
                                           (lambda: list(info["classnames"])) if "classnames" in info
                                           else imagenet_classnames, "class names")
            default_name = info.get("task", "imagenet")
        self.name = default_name if c.name is None else c.name
        self.templates = resolve_list(c.templates,
                                      (lambda: list(info["templates"])) if "templates" in info
                                      else openai_imagenet_templates, "templates")
        context = model.config.text.context_length
        if tokenizer is None:
            tokenizer = (info["tokenizer"](context) if "tokenizer" in info
                         else common.tokenizer_from(c.tokenizer, context, "zero-shot evaluator"))
        self.tokenizer = tokenizer
        self.threads = c.num_threads
        self.encoder = common.Encoder(model, c.batch_size, c.normalization)
        self.bprw = _settings(c.bprw or ())
        self.bprw_only = c.bprw_only
        self.out_dir = c.out_dir
        self.prompt_select = _settings(c.prompt_select)

    @classmethod
    def parse(cls, config: Any) -> Config:
        """The typed `Config` of a config.evals section (a dict or ConfigDict)."""
        return common.parse_config(Config, config, cls.KIND)

    def encode(self, params: Any, progress: Callable[[int], None] | None = None
               ) -> dict[str, np.ndarray]:
        """{"text_mu", "text_logvar" [C*T, D], "image_mu", "image_logvar" [N, D], "label" [N]}
        (the log sigma^2 are None for a deterministic model)."""
        tokens = common.tokenize_checked(self.tokenizer, prompts(self.classnames, self.templates),
                                         f"zero-shot {self.name} prompts")
        text_mu, text_lv = self.encoder.texts(params, tokens)
        batches = self.data.batches(self.encoder.batch_size * jax.process_count(),
                                    self.image_size, self.encoder.normalization, self.threads)
        img = self.encoder.dataset(params, batches, len(self.data), progress, fields=("label",))
        label = img.get("label", np.zeros(len(self.data), np.int32)).astype(np.int32)
        if label.size and (label.max() >= len(self.classnames) or label.min() < 0):
            raise ValueError(f"labels span {label.min()}..{label.max()} but there are "
                             f"{len(self.classnames)} class names")
        return {"text_mu": text_mu, "text_logvar": text_lv, "image_mu": img["mu"],
                "image_logvar": img.get("logvar"), "label": label}

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]:
        enc = self.encode(params, progress)
        n_cls, n_tpl = len(self.classnames), len(self.templates)
        probabilistic = enc["text_logvar"] is not None and enc["image_logvar"] is not None
        text_lv = enc["text_logvar"] if probabilistic else np.zeros_like(enc["text_mu"])
        class_mu, class_s2 = class_embeddings(enc["text_mu"], text_lv, n_cls, n_tpl)
        img_mu, labels = enc["image_mu"], enc["label"]
        pre = f"zeroshot/{self.name}"
        if not self.bprw_only:
            if not probabilistic:   # a deterministic model: mu . mu scores only
                rank = ranks(img_mu, labels, class_mu, class_s2, "dot")
                yield f"{pre}/top1_dot", common.percent(np.mean(rank < 1))
                yield f"{pre}/top5_dot", common.percent(np.mean(rank < 5))
                return
            unc = common.uncertainty(enc["image_logvar"])
            for kind in ("dot", "csd"):
                rank = ranks(img_mu, labels, class_mu, class_s2, kind)
                yield f"{pre}/top1_{kind}", common.percent(np.mean(rank < 1))
                yield f"{pre}/top5_{kind}", common.percent(np.mean(rank < 5))
                # 10 bins (fewer only for sets of < 10 images, which would leave bins empty)
                accs, corr = common.binned_accuracy((rank < 1).astype(np.float64), unc,
                                                    bins=max(1, min(10, len(rank))))
                for i, a in enumerate(accs):
                    yield f"{pre}/unc_bin{i}_top1_{kind}", float(a)
                yield f"{pre}/unc_corr_{kind}", float(corr)
            yield f"{pre}/image_sigma2_trace_mean", float(unc.mean())
            yield f"{pre}/text_sigma2_trace_mean", float(common.uncertainty(enc["text_logvar"]).mean())
        if self.bprw and not probabilistic:
            raise ValueError("BPRW needs a probabilistic model (log sigma^2); this one is deterministic")
        for setting in self.bprw:
            yield from self._bprw(setting, enc, class_mu, class_s2)
        if self.prompt_select and not probabilistic:
            raise ValueError("prompt_select needs a probabilistic model (log sigma^2)")
        for setting in self.prompt_select:
            yield from self._prompt_select(setting, enc, class_mu, class_s2)

    def _prompt_select(self, setting: Any, enc: dict[str, np.ndarray], class_mu: np.ndarray,
                       class_s2: np.ndarray) -> Iterator[tuple[str, float]]:
        """Accuracy with the templates an uncertainty rule keeps per class (paper Table 3)."""
        n_cls, n_tpl = len(self.classnames), len(self.templates)
        text_mu = enc["text_mu"].reshape(n_cls, n_tpl, -1)
        text_s2 = np.exp(enc["text_logvar"].reshape(n_cls, n_tpl, -1).astype(np.float64))
        keep = prompt_selection.select(text_s2.sum(-1), setting)
        new_mu, new_s2 = prompt_selection.selected_classifier(text_mu, text_s2, keep)
        img_mu, labels = enc["image_mu"], enc["label"]
        pre = f"promptsel/{self.name}/{prompt_selection.label(setting)}"
        for kind in ("dot", "csd"):
            yield f"{pre}/top1_{kind}_base", topk_accuracy_ranked(img_mu, labels, class_mu, class_s2, kind)
            yield f"{pre}/top1_{kind}", topk_accuracy_ranked(img_mu, labels, new_mu, new_s2, kind)
        yield f"{pre}/kept_mean", float(keep.sum(1).mean())
        yield f"{pre}/kept_min", float(keep.sum(1).min())

    def _bprw(self, setting: Any, enc: dict[str, np.ndarray], class_mu: np.ndarray,
              class_s2: np.ndarray) -> Iterator[tuple[str, float]]:
        """BPRW (naver-ai/prolip src/prolip/zero_shot_classifier.py) for one setting: accuracy with / without re-weighting."""
        cfg = prompt_reweighting.parse_config(setting)
        mode = setting if setting in ("nn", "fewshot") else cfg.spec + ("-gt" if cfg.use_gt else "")
        n_cls, n_tpl = len(self.classnames), len(self.templates)
        text_mu = enc["text_mu"].reshape(n_cls, n_tpl, -1).astype(np.float64)
        text_s2 = np.exp(enc["text_logvar"].reshape(n_cls, n_tpl, -1).astype(np.float64))
        img_mu, labels = enc["image_mu"], enc["label"]
        weights, info = prompt_reweighting.bprw_weights(
            text_mu, text_s2, img_mu, enc["image_logvar"], cfg, labels=labels,
            seed=self.config.bprw_seed)
        new_mu, new_s2 = prompt_reweighting.reweighted_classifier(weights, text_mu, text_s2)
        pre = f"bprw/{self.name}/{mode}"
        if cfg.use_gt and self.config.bprw_exclude_support:
            # score only images that were not used as few-shot examples (the reference scores
            # the whole set, support images included)
            keep = np.ones(len(labels), bool)
            keep[info["images"].ravel()] = False
            img_mu, labels = img_mu[keep], labels[keep]
        for kind in ("dot", "csd"):
            yield f"{pre}/top1_{kind}_base", topk_accuracy_ranked(img_mu, labels, class_mu, class_s2, kind)
            yield f"{pre}/top1_{kind}", topk_accuracy_ranked(img_mu, labels, new_mu, new_s2, kind)
        for key, value in prompt_reweighting.weight_stats(weights).items():
            yield f"{pre}/{key}", value
        yield f"{pre}/em_iterations", float(info["iterations"].mean())
        if self.out_dir:
            prompt_reweighting.save_weights(self.out_dir, f"bprw_{self.name}_{mode}", weights,
                                            self.classnames, self.templates, cfg)


class BPRWEvaluator(Evaluator):
    """The zero-shot evaluator with BPRW on (the same `Config`; `bprw` defaults to
    ("nn", "fewshot")); `run(params)` yields only the `bprw/...` metrics."""
    KIND = "prompt_reweighting"

    @classmethod
    def parse(cls, config: Any) -> Config:
        c = super().parse(config)
        return dataclasses.replace(c, bprw=("nn", "fewshot") if c.bprw is None else c.bprw,
                                   bprw_only=True)
