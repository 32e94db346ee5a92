r"""Zero-shot classification on your own ImageFolder directory (and retrieval on held-out tar shards).

    python scripts/evaluate.py --checkpoint workdirs/mine --config configs/eval/imagefolder.py \
        --out workdirs/mine/eval --config.root=/data/digits --config.split=val
    # + retrieval on image-caption tar shards in the training layout
    python scripts/evaluate.py --checkpoint workdirs/mine --config configs/eval/imagefolder.py:evals=zeroshot+retrieval \
        --out workdirs/mine/eval --config.root=/data/digits --config.shards='/data/val-{0000..0001}.tar'

Config args (`--config configs/eval/imagefolder.py:evals=retrieval`):
    evals=a+b      evaluators, of zeroshot (default) and retrieval

Fields (`--config.<field>=value`; each evaluator reads them, so one override sets both):
    root           the ImageFolder root: images at <root>/<split>/<class folder>/*.png|jpg|...
    split          its sub-folder ("val")
    classnames     "" (default): the class folder names, "_" -> " ", in sorted order (the labels'
                   order). Or a file: one name per line / a JSON list, in the SORTED-FOLDER order,
                   or a JSON object {folder: name}. A list in another order, or with names that
                   are not the folders, is an error saying what differs (evaluators/zeroshot.py
                   `imagefolder_classnames`): a wrong order would silently score below chance.
    class_index    "" (sorted folders), or a text file of the folders, one per line, in the
                   order of your class names (label i = line i)
    templates      prompt templates, one `{}` each, as a tuple literal:
                   --config.templates="('a photo of the number {}.', 'a handwritten {}.')"
                   (default: three generic ones; ImageNet's 80 are in
                   evaluators/data/openai_imagenet_templates.json)
    num_images     score only the first N images (0: all)
    shards         retrieval: tar shards of <key>.<image> + <key>.txt (the training layout),
                   files, globs or a brace pattern
    tokenizer      path "" (default): the tokenizer recorded in the checkpoint (scripts/evaluate.py);
                   or kind ("sentencepiece", "hf" or "clip_bpe") and path of another one
                   (its context length is the model's)
    batch_size     images per batch (256)

Metrics: zeroshot/<root folder name>/top1_csd, top1_dot, top5_*, accuracy by image-uncertainty
bin; retrieval/tar/csd/i2t_R@1 ... (see evaluators/zeroshot.py, evaluators/retrieval.py).
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args

ALL = ("zeroshot", "retrieval")
TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "{}")


def get_config(arg=None):
    args = config_args.parse(arg, evals="zeroshot")
    evals = args["evals"].split("+")
    unknown = sorted(set(evals) - set(ALL))
    if unknown:
        raise ValueError(f"unknown evaluators {unknown}; known: {ALL}")

    c = mlc.ConfigDict()
    c.root = ""
    c.split = "val"
    c.classnames = ""
    c.class_index = ""
    c.templates = TEMPLATES
    c.num_images = 0
    c.shards = ""
    c.batch_size = 256
    # One ConfigDict shared by the evaluators: `--config.tokenizer.path=...` sets it for all.
    c.tokenizer = mlc.ConfigDict(dict(kind="sentencepiece", path=""))
    c.evals = mlc.ConfigDict()
    # The evaluators hold references to the fields above (resolved when the config is read).
    if "zeroshot" in evals:
        c.evals.zeroshot = mlc.ConfigDict(dict(
            type="zeroshot", dataset="imagefolder", root=c.get_ref("root"), split=c.get_ref("split"),
            classnames=c.get_ref("classnames"), class_index=c.get_ref("class_index"),
            templates=c.get_ref("templates"), num_images=c.get_ref("num_images"),
            batch_size=c.get_ref("batch_size")))
        c.evals.zeroshot.tokenizer = c.tokenizer
    if "retrieval" in evals:   # one caption per image: no image->image / text->text positives
        c.evals.retrieval = mlc.ConfigDict(dict(
            type="retrieval", dataset="tar", path=c.get_ref("shards"), num_images=c.get_ref("num_images"),
            batch_size=c.get_ref("batch_size"), scores=("csd", "dot"), same_modality=()))
        c.evals.retrieval.tokenizer = c.tokenizer
    return c
