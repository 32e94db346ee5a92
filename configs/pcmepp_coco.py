r"""PCME++ on COCO: ViT-B/32 from OpenAI CLIP, the paper's COCO recipe.

Paper: "Improved Probabilistic Image-Text Representations" (Chun; "PCME++").
Hardware and time: 25 epochs of COCO at batch 128 from CLIP ViT-B/32, a single-accelerator
job, not run or timed here; `:size=cpu` is a few minutes on CPU.

    python -m prolip_jax.train --config configs/pcmepp_coco.py --workdir W \
        --config.data.caption_file=/data/coco/dataset_coco.json --config.data.image_root=/data/coco \
        --config.data.tokenizer.path=/data/bpe_simple_vocab_16e6.txt.gz
    python scripts/evaluate.py --checkpoint W/best --config configs/eval/coco.py --out W/eval \
        --config.karpathy_json=... --config.image_root=... --config.instances=...

Args as configs/caption_recipes.py (dataset=coco|flickr30k|cub, size=paper|cpu, noise=0.2).

| item (PCME++ Table B.1, App. B.2; naver-ai/pcmepp configs) | paper | here |
|---|---|---|
| init | CLIP ViT-B/32; log sigma^2 block and GPO random | the same (config.init) |
| epochs, batch | 25, 128 | 25 x 4,425 steps, 128 |
| optimiser | AdamP, lr 5e-4, betas (0.9, 0.999), eps 1e-8, wd 1e-4 | the same (optim.name=adamp) |
| lr schedule | constant, x0.1 for the last 10 epochs | step schedule at 15/25 |
| layer-wise lr decay; backbone lr | 0.7; visual x0.01, text x0.1 | the same (layer_decay, groups) |
| visual backbone | frozen 2 epochs, then 1 epoch of linear warm-up (code: `embedding_warmup_epochs 2` + `embedding_warmup_after_freeze`, the whole loss x (batch + 1) / batches in epoch 2) | locked, unlock_step 2 epochs, unlock_warmup_steps 1 epoch, unlock_warmup_form "loss" (the code's loss ramp) |
| grad clip | 2 (code) | 2 |
| loss | a = b = 5 init, PP alpha 0.1, VIB beta 1e-4, MSDA 25% (Mixup / CutMix, Beta(2, 2)) | the same |
| SizeAugment | images and captions | images only (CLIP BPE has no [MASK] id) |
| embedding | 1024-d new Linear on every token, GPO | a new 1024-d projection (no bias, after CLIP's ln_post) on every token, GPO |
| SWA | last 10 epochs (code: from epoch 16, every epoch) | swa from epoch 16 every epoch -> W/swa |
| model selection | best validation RSUM | keep_best on retrieval/val/csd/1k/rsum -> W/best |

Published (PCME++ Table 1, ViT-B/32, mean of i2t and t2i, 3 runs): ECCV mAP@R 40.1, ECCV R-P
49.7, ECCV R@1 83.1, CxC R@1 56.8, COCO 1K R@1 75.4, 5K R@1 55.1, RSUM 537.0; SWA: 40.2 / 49.8 /
82.9 / 56.8 / 75.5 / 55.2 / 537.3. Not reproduced here (no COCO or GPU on the machine this was
written on).
"""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    return config_args.load_config_file(str(Path(__file__).with_name("caption_recipes.py")) + ":method=pcmepp"
                                        + (f",{arg}" if arg else ""))
