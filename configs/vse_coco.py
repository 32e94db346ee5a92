r"""VSE∞ on COCO as PCME++ runs it (PCME++ §3.1): deterministic, hardest-negative triplet.

Papers: VSE∞, "Learning the Best Pooling Strategy for Visual Semantic Embedding" (Chen et al.),
as the baseline of "Improved Probabilistic Image-Text Representations" (Chun; "PCME++").
Hardware and time: 25 epochs of COCO at batch 128 from CLIP ViT-B/32, a single-accelerator
job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/vse_coco.py --workdir W --config.data.caption_file=... \
        --config.data.image_root=... --config.data.tokenizer.path=bpe_simple_vocab_16e6.txt.gz

| item | PCME++'s VSE∞ | here |
|---|---|---|
| towers | CLIP ViT-B/32, GPO | the same (mu only: embed_unc False, GPO on both towers) |
| loss | triplet, hardest negatives, margin 0.2; VSE∞'s warm-up epoch with the sum | the same (objective vse, sum_warmup_steps = 1 epoch) |
| optimiser, schedule, freeze | as PCME++ | the same (configs/pcmepp_coco.py) |

Published (PCME++ Table 1, ViT-B/32): ECCV mAP@R 40.0, R-P 49.5, ECCV R@1 83.1, CxC R@1 57.1,
COCO 1K R@1 75.5, 5K R@1 55.2, RSUM 536.5. Not reproduced here.
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=vse"
                                        + (f",{arg}" if arg else ""))
