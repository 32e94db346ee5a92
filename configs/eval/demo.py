r"""Offline evaluation on the built-in demo dataset (zero-shot, retrieval, uncertainty analyses).

    python scripts/evaluate.py --checkpoint /tmp/prolip_tiny --config configs/eval/demo.py --out /tmp/eval

Config args (`--config configs/eval/demo.py:evals=uncertainty,small=1`):
    evals=a+b+c    evaluators to include, of zeroshot, retrieval, uncertainty (default: all three)
                   and hierarcaps (the HierarCaps traversal on the demo's 4 caption levels)
    cache_dir=DIR  demo cache folder (default: input_pipeline.demo.default_cache_dir())
    image_size=N   stored size of the demo images (default 64, the DemoConfig default; `make
                   demo` uses 32). The held-out splits do not depend on the train split.
    num_train=N    size of the (unused) train split in the cache folder (default 200)
    small=1        tiny splits (200 train, 36 zero-shot, 20 retrieval, 10 hierarchies, 16 px
                   stored images): a smoke test in seconds

Image size and context length are the checkpoint's (each evaluator reads them from the model
config), so the same file serves `tiny`, `micro` and full-size models. Expected run time for the
`tiny` model on 2 CPU cores: about a minute (demo generation on first use included).
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args

ALL = ("zeroshot", "retrieval", "uncertainty")
OPTIONAL = ("hierarcaps",)


def get_config(arg=None):
    args = config_args.parse(arg, evals="+".join(ALL), cache_dir="", small="0", image_size="64",
                             num_train="200")
    # One DemoConfig for all evaluators: they share one generated cache folder. The eval splits
    # are the DemoConfig defaults (1,080 zero-shot, 500 retrieval, 500 hierarchies); the train
    # split is not read here, so a small one keeps the first generation quick.
    demo = dict(image_size=int(args["image_size"]), num_train=int(args["num_train"]))
    if args["small"] == "1":
        demo = dict(image_size=16, num_train=200, num_zeroshot=36, num_retrieval=20, num_levels=10)
    if args["cache_dir"]:
        demo["cache_dir"] = args["cache_dir"]

    c = mlc.ConfigDict()
    c.evals = mlc.ConfigDict()
    evals = args["evals"].split("+")
    unknown = sorted(set(evals) - set(ALL + OPTIONAL))
    if unknown:
        raise ValueError(f"unknown evaluators {unknown}; known: {ALL + OPTIONAL}")
    if "zeroshot" in evals:   # 36 colour x shape classes, 4 templates (paper §4.2 protocol)
        c.evals.zeroshot = dict(type="zeroshot", dataset="demo", task="object", demo=demo)
    if "retrieval" in evals:  # one level-3 caption per image: no image->image or text->text positives
        c.evals.retrieval = dict(type="retrieval", dataset="demo", demo=demo, scores=("csd", "dot"),
                                 same_modality=())
    if "uncertainty" in evals:  # four caption levels per image (paper §4.3, C.6)
        c.evals.uncertainty = dict(type="uncertainty", dataset="demo", split="levels", demo=demo,
                                   image_keep_ratio=0.75, text_mask_prob=0.75, inclusion_eps=0.0)
    if "hierarcaps" in evals:  # traversal from each image towards [ROOT] (paper §4.4, B.4)
        c.evals.hierarcaps = dict(type="hierarcaps", dataset="demo", demo=demo)
    return c
