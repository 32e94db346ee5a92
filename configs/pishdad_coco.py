r"""Pishdad et al. on COCO (their §4.2): probabilistic VSE++, -W2 triplet, on CLIP ViT-B/32.

Paper: "Uncertainty-based Cross-Modal Retrieval with Probabilistic Representations" (Pishdad
et al.). Hardware and time: 30 epochs of COCO at batch 128 from CLIP ViT-B/32, a
single-accelerator job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/pishdad_coco.py --workdir W --config.data.caption_file=... \
        --config.data.image_root=... --config.data.tokenizer.path=bpe_simple_vocab_16e6.txt.gz

| item | paper | here |
|---|---|---|
| towers | ResNet-152 (frozen) + GRU over random 300-d words; duplicated embedding layers for sigma^2 | CLIP ViT-B/32 (visual trunk locked) with a duplicated projection for sigma^2 |
| loss | hardest-negative triplet, margin 0.2, -W2, ellipsoidal, variances in [0.1, 10] | the same (objective pishdad), after VSE∞'s one warm-up epoch with the sum over negatives |
| optimiser | Adam lr 2e-4, /10 at epoch 15 of 30, batch 128 | AdamW with wd 0 (= Adam), step schedule at 1/2 |
| model selection | validation rsum | the same |

Published (Pishdad et al. Table 1, "VSE++ ours", COCO 1K i2t / t2i): PMRP 41.1 / 41.7, R@1 59.3 /
45.6; 5K: PMRP 31.3 / 31.2, R@1 34.7 / 24.5. A CLIP trunk is a much stronger start: the recall
should be far above these, the comparison of interest is with configs/vse_coco.py. Not
reproduced here.
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=pishdad"
                                        + (f",{arg}" if arg else ""))
