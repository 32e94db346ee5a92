r"""DAA on PCME (DAA §5.2; its code's config/coco/pcme_coco.yaml), on the PCME++ towers.

Paper: "A Differentiable Semantic Metric Approximation in Probabilistic Embedding for Cross-Modal
Retrieval" (Li et al.; "DAA"), on PCME, "Probabilistic Embeddings for Cross-Modal Retrieval"
(Chun et al.), with the towers of "Improved Probabilistic Image-Text Representations" (Chun;
"PCME++"). Hardware and time: 70 epochs of COCO at batch 128 from CLIP ViT-B/32, a
single-accelerator job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/daa_coco.py --workdir W --config.data.caption_file=... \
        --config.data.image_root=... --config.data.tokenizer.path=bpe_simple_vocab_16e6.txt.gz

| item | paper / code | here |
|---|---|---|
| towers | ResNet-152 + BERT-base ("PCME-bert"), D 1024 | CLIP ViT-B/32 with PCME++'s heads |
| loss | PCME (J = 5, VIB 1e-5, a = b = 15) + 1000 x DAA (tau 0.01) | the same (objective pcme_daa) |
| semantic map | TF-IDF of the split's captions (code) | in-batch TF-IDF of token ids |
| optimiser | AdamP lr 1.5e-4, wd 0, clip 2 | the same |
| phases | 3 warm-up + 27 pre-training (visual trunk frozen) + 40 fine-tuning epochs | the same: visual trunk locked until epoch 30 |
| lr schedule (code: train_coco.py) | cosine T_max 30 epochs over pre-training; fine-tuning restarts it at lr x0.1 with a new optimiser (rising again after its epoch 30), stepped per epoch, from the best pre-training checkpoint | schedule "cosine_phases" (prolip_jax/core/optim.py): the same lrs, by update count (no per-epoch staircase); Adam moments carried over; the last pre-training step, not the best |
| batch | 128 (COCO), 150 (CUB) | the same |

`:size=cpu` (batch 32, random tiny towers) scales the DAA weight to 1000 x (32/128)^2 = 62.5: at
1000 both towers collapse to one point each (docs/recipes.md has the measurements).

Published (DAA Table 1, PCME-bert + DAA, COCO 1K / 5K, i2t then t2i): PMRP 45.9 / 46.7 and
34.6 / 34.9, R@1 71.2 / 57.8 and 48.2 / 35.1, ASP 58.4 / 57.2 and 58.3 / 57.0. CUB (Table 2):
R-P 28.2 / 28.5, R@1 53.2 / 37.7, ASP 53.4 / 57.6. Not reproduced here.
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=daa"
                                        + (f",{arg}" if arg else ""))
