r"""CLIP's InfoNCE on COCO as PCME++'s baseline (PCME++ §3.1, App. A.3), on the same towers.

Paper: the InfoNCE baseline of "Improved Probabilistic Image-Text Representations" (Chun; "PCME++").
Hardware and time: 25 epochs of COCO at batch 128 from CLIP ViT-B/32, a single-accelerator
job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/infonce_coco.py --workdir W --config.data.caption_file=... \
        --config.data.image_root=... --config.data.tokenizer.path=bpe_simple_vocab_16e6.txt.gz

| item | PCME++'s InfoNCE | here |
|---|---|---|
| towers | CLIP ViT-B/32, GPO | the same (mu only, GPO) |
| loss | InfoNCE, initial softmax temperature 1.0 | objective clip, logit scale init log 1 = 0 (a = 1) |
| optimiser, schedule, freeze | as PCME++ | the same |

Published (PCME++ Table 1, ViT-B/32): ECCV mAP@R 39.0, R-P 48.7, ECCV R@1 81.7, CxC R@1 54.9,
COCO 1K R@1 74.0, 5K R@1 53.0, RSUM 532.6. Not reproduced here.
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=infonce"
                                        + (f",{arg}" if arg else ""))
