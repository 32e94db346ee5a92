r"""PCME on COCO as PCME++ runs its baseline (PCME++ §3.1 / App. B.2), on the PCME++ towers.

Papers: PCME, "Probabilistic Embeddings for Cross-Modal Retrieval" (Chun et al.), as the
baseline of "Improved Probabilistic Image-Text Representations" (Chun; "PCME++").
Hardware and time: 25 epochs of COCO at batch 128 from CLIP ViT-B/32, a single-accelerator
job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/pcme_coco.py --workdir W --config.data.caption_file=... \
        --config.data.image_root=... --config.data.tokenizer.path=bpe_simple_vocab_16e6.txt.gz

| item | PCME++'s PCME baseline | here |
|---|---|---|
| towers, optimiser, schedule, freeze | as PCME++ (configs/pcmepp_coco.py) | the same |
| loss | MC match probability, J = 8 samples, VIB (code: 1e-3), a = b = 5 init | the same (objective pcme) |
| MSDA, pseudo-positives | none | none |
| PCME's own heads (attention + residual, Chun et al. 2021) | - | PCME++'s duplicated block + GPO |

Published (PCME++ Table 1, ViT-B/32): ECCV mAP@R 39.1, R-P 48.9, ECCV R@1 81.4, CxC R@1 54.7,
COCO 1K R@1 73.8, 5K R@1 53.0, RSUM 532.0. Not reproduced here.
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=pcme"
                                        + (f",{arg}" if arg else ""))
