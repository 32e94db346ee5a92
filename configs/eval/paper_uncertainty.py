r"""The paper's uncertainty-aware evaluation on real data (§4.3-4.4, Tables 2-3, appendix C).

    python scripts/evaluate.py --checkpoint CKPT --out DIR --config \
      configs/eval/paper_uncertainty.py:coco_json=dataset_coco.json,coco_root=COCO,hcaps_csv=hierarcaps_test.csv,hcaps_images=COCO/val2014,imagenet=IMAGENET,tokenizer=TOK

Config args (an evaluator whose paths are empty is left out):
    coco_json, coco_root   Karpathy split file + COCO image folder -> "retrieval" (COCO 5K/1K,
                           recall per uncertainty bin, i2i / t2t)
    hcaps_csv, hcaps_images  HierarCaps test CSV + COCO val images -> "hierarcaps" (Table 2)
    imagenet               ImageFolder root with val/<wnid>/ -> "zeroshot" with BPRW (nn,
                           fewshot) and prompt selection (sigma filter, top-10; Table 3)
    tokenizer, tokenizer_kind (sentencepiece)   the model's tokenizer file
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args


def get_config(arg=None):
    a = config_args.parse(arg, coco_json="", coco_root="", hcaps_csv="", hcaps_images="",
                          imagenet="", tokenizer="", tokenizer_kind="sentencepiece")
    tok = dict(kind=a["tokenizer_kind"], path=a["tokenizer"])
    c = mlc.ConfigDict()
    c.evals = mlc.ConfigDict()
    if a["coco_json"]:
        c.evals.retrieval = dict(type="retrieval", dataset="karpathy", karpathy_json=a["coco_json"],
                                 image_root=a["coco_root"], tokenizer=tok, unc_bins=10,
                                 same_modality=("i2i", "t2t"))
    if a["hcaps_csv"]:
        c.evals.hierarcaps = dict(type="hierarcaps", dataset="hierarcaps", csv=a["hcaps_csv"],
                                  image_dir=a["hcaps_images"], tokenizer=tok,
                                  roots=("null", "inclusion", "inclusion+null"))
    if a["imagenet"]:
        c.evals.imagenet = dict(type="zeroshot", dataset="imagefolder", root=a["imagenet"],
                                tokenizer=tok, bprw=("nn", "fewshot"),
                                prompt_select=[dict(kind="sigma_filter", coeff=0.0),
                                               dict(kind="topk", k=10)])
    if not c.evals:
        raise ValueError("paper_uncertainty: give at least one of coco_json, hcaps_csv, imagenet")
    return c
