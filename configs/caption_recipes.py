r"""COCO / Flickr30K / CUB caption-retrieval recipes of the probabilistic-embedding papers, one builder.

The papers (named by their short names below):
  PCME++   "Improved Probabilistic Image-Text Representations" (Chun)
  PCME     "Probabilistic Embeddings for Cross-Modal Retrieval" (Chun et al.)
  Pishdad  "Uncertainty-based Cross-Modal Retrieval with Probabilistic Representations"
           (Pishdad et al.)
  DAA      "A Differentiable Semantic Metric Approximation in Probabilistic Embedding for
           Cross-Modal Retrieval" (Li et al.)
  VSE∞     "Learning the Best Pooling Strategy for Visual Semantic Embedding" (Chen et al.)

The per-method files (configs/pcmepp_coco.py, pcme_coco.py, pishdad_coco.py, daa_coco.py,
vse_coco.py, infonce_coco.py) hold each paper's hyper-parameter table, its published numbers and
where the recipe differs; they load this file with `method=NAME`, and RECIPES is the one place
a recipe's settings live (`configs/caption_recipes.py:method=NAME` is the same config).

    python -m prolip_jax.train --config configs/pcmepp_coco.py --workdir W \
        --config.data.caption_file=/data/coco/dataset_coco.json --config.data.image_root=/data/coco \
        --config.data.tokenizer.path=/data/bpe_simple_vocab_16e6.txt.gz \
        --config.init.path=timm/vit_base_patch32_clip_224.openai

Config args (`--config configs/pcmepp_coco.py:dataset=flickr30k,size=cpu`):
    dataset=coco | flickr30k | cub   the training captions (input_pipeline/captions.py); the
                                     epoch length below assumes the Karpathy / PCME split sizes
    size=paper | cpu                 cpu: the `tiny` towers (CPU_TOWERS), 32 px, batch
                                     32, ~200 steps with the recipe's epochs scaled down, no
                                     warm start, lr 2e-3 after 20 warm-up steps, no backbone
                                     multipliers or freeze, triplet sum for a third of the run,
                                     identical captions positives too (targets "both"):
                                     what tests/test_caption_recipes.py trains on generated
                                     captions (the caller passes a tokenizer.json, "hf" kind)
    noise=0.2                        noisy correspondence (PCME++ §3, after NCR): this
                                     fraction of training pairs shuffled; the list is written
                                     to WORKDIR/noisy_pairs.json

Shared by every recipe (PCME++ App. B.2 and its code, unless the method says otherwise):
- towers: OpenAI CLIP ViT-B/32 (`open_clip:ViT-B-32-quickgelu`), warm-started from its weights
  (`config.init.path`, any copy open_clip or the hub can read); the method's heads on top,
  initialised fresh. The joint embedding is 1024-d as in the papers' COCO runs (PCME++'s code
  `embed_size: 1024`; DAA and Pishdad et al.: D = 1024): CLIP's 512-d projections are replaced by
  new 1024-d ones (`model.embed_dim`, `init.fresh`), CLIP's ln_post kept before them.
- data: one record per caption (566,435 Karpathy train+restval captions of COCO: 4,425 steps per
  epoch at batch 128), images at 224 px with the pipeline's random resized crop and no colour
  jitter (the papers' own transforms are not reproduced), CLIP normalisation, the CLIP BPE
  tokenizer (context 77); every caption of an image in a batch is its positive
  (`targets.positives="image_id"`).
- model selection: validation RSUM (COCO 1K folds of the Karpathy val split) every epoch; the
  best step is kept in WORKDIR/best (`keep_best`).

Hardware and time: size=paper is 25 to 70 epochs of COCO at batch 128 (4,425 steps an epoch)
from CLIP ViT-B/32, a single-accelerator job; none has been run or timed here. size=cpu: about
200 steps of the tiny towers on CPU, a minute or two each (tests/test_caption_recipes.py
trains them). Why size=cpu differs where it does: docs/recipes.md.
"""
from __future__ import annotations

import math

import ml_collections as mlc

from prolip_jax.runtime import config_args

CPU_STEPS = 200
# The papers' joint embedding on COCO, and the CLIP parameters that become new projections of that
# size (prolip_jax/core/pretrained/warm_start.py InitConfig.fresh) instead of being loaded.
EMBED_DIM = 1024
NEW_PROJECTIONS = ("^visual/proj$", "^text/text_projection/")
# Training captions per epoch (one record per caption) of each dataset's training split.
EPOCH_CAPTIONS = {"coco": 113_287 * 5, "flickr30k": 29_000 * 5, "cub": 8_855 * 10}

# Parameter paths of the CLIP trunks (prolip_jax/core/optim.py matches them with re.search): what the
# backbone lr multipliers and PCME++'s 2-epoch freeze apply to. The heads (GPO, the duplicated
# block, projections, ln_post / ln_final) stay at the base lr.
VISUAL_TRUNK = r"^visual/(patch_kernel|class_embedding|positional_embedding|ln_pre|transformer)/"
TEXT_TRUNK = r"^text/(token_embedding|positional_embedding|transformer)/"

# PCME++'s heads (PCME++ §2.1, Fig. 2): the last block duplicated for log sigma^2 and GPO on
# both branches; SizeAugment on image tokens (the caption SizeAugment needs a [MASK] id that the
# CLIP BPE vocabulary lacks, so it is off on text).
PCMEPP_HEADS = dict(vision=dict(embed_unc=True, unc_head="block", pool="gpo", size_augment=0.2, init_unc_bias=0.0),
                    text=dict(embed_unc=True, unc_head="block", pool="gpo", pad_id=0, init_unc_bias=0.0))

# method -> settings. `loss`: the objective's Config fields; `optim`: config.optim fields (epochs
# are turned into steps by `build`); `model`: config.model fields; `targets`: config.targets.
RECIPES: dict[str, dict] = {
    # PCME++ Table B.1 and naver-ai/pcmepp configs/pcmepp.yaml. The warm-up after the
    # 2-epoch freeze: its code's `embedding_warmup_epochs 2` + `embedding_warmup_after_freeze`
    # multiply the whole loss by (batch + 1) / batches in epoch 2 (pcmepp/engine.py; its
    # `linear_warmup: false` leaves epochs 0-1 unscaled), as VSE∞'s code does after its freeze:
    # unlock_warmup_form "loss" (prolip_jax/core/optim.py), not an lr ramp of the trunk alone.
    "pcmepp": dict(
        loss=dict(objective="pcmepp", pp_alpha=0.1, vib_beta=1e-4),
        model=dict(init_logit_scale=math.log(5.0), init_logit_bias=5.0, **PCMEPP_HEADS),
        targets=dict(positives="image_id", mix_fraction=0.25),
        optim=dict(name="adamp", lr=5e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, clip_norm=2.0,
                   schedule="step", step_boundaries=(15 / 25,), layer_decay=0.7,
                   groups=({"pattern": VISUAL_TRUNK, "lr_mult": 0.01}, {"pattern": TEXT_TRUNK, "lr_mult": 0.1}),
                   locked=(VISUAL_TRUNK,), unlock_epoch=2, unlock_warmup_epochs=1, unlock_warmup_form="loss",
                   swa_start_epoch=16, swa_every_epochs=1),
        epochs=25),
    # PCME as PCME++ configures its baseline (PCME++ §1.7 / App. B.2: the same a, b init and
    # VIB, J = 8 samples; its code: vib_beta 1e-3); the PCME++ trunk and optimiser.
    "pcme": dict(
        loss=dict(objective="pcme", num_samples=8, vib_beta=1e-3),
        model=dict(init_logit_scale=math.log(5.0), init_logit_bias=5.0, **PCMEPP_HEADS),
        targets=dict(positives="image_id"),
        optim="pcmepp", epochs=25),
    # DAA on PCME (DAA §5.2 and its code's config/coco/pcme_coco.yaml): a = b = 15,
    # daa_beta 1000, tau 0.01, vib 1e-5, J = 5, AdamP lr 1.5e-4, wd 0, clip 2, 70 epochs: 30 of
    # pre-training (3 of warm-up; the image trunk frozen), then 40 of fine-tuning at lr x0.1 with a
    # new cosine (its train_coco.py; T_max 30 epochs, so the cosine rises again for the last 10):
    # prolip_jax/core/optim.py warmup_cosine_phases.
    "daa": dict(
        loss=dict(objective="pcme_daa", num_samples=5, vib_beta=1e-5, daa_beta=1000.0, daa_tau=0.01),
        model=dict(init_logit_scale=math.log(15.0), init_logit_bias=15.0, **PCMEPP_HEADS),
        targets=dict(positives="image_id"),
        optim=dict(name="adamp", lr=1.5e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, clip_norm=2.0,
                   schedule="cosine_phases", warmup_epochs=3, cosine_epochs=30, step_boundaries=(30 / 70,),
                   step_factor=0.1, locked=(VISUAL_TRUNK,), unlock_epoch=30),
        epochs=70),
    # Pishdad et al. §4.2: Adam lr 2e-4 (/10 at epoch 15 of 30), batch 128, margin 0.2,
    # -W2, ellipsoidal, variances in [0.1, 10]; the image backbone frozen (their "VSE++").
    "pishdad": dict(
        loss=dict(objective="pishdad", similarity="wasserstein", covariance="ellipsoidal", margin=0.2,
                  sum_warmup_epochs=1),
        model=dict(vision=dict(embed_unc=True, unc_head="embedding"),
                   text=dict(embed_unc=True, unc_head="embedding")),
        targets=dict(positives="image_id"),
        optim=dict(name="adamw", lr=2e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                   schedule="step", step_boundaries=(0.5,), locked=(VISUAL_TRUNK,)),
        epochs=30),
    # VSE∞ as PCME++ runs it (PCME++ §1.7): hardest-negative triplet, margin 0.2, its warm-up
    # epoch with the sum; GPO on the mean branch only; PCME++'s optimiser.
    "vse": dict(
        loss=dict(objective="vse", margin=0.2, sum_warmup_epochs=1),
        model=dict(vision=dict(embed_unc=False, pool="gpo", size_augment=0.2),
                   text=dict(embed_unc=False, pool="gpo", pad_id=0)),
        targets=dict(positives="image_id"),
        optim="pcmepp", epochs=25),
    # CLIP's InfoNCE as PCME++'s baseline (PCME++ §1.7: initial softmax temperature 1.0).
    "infonce": dict(
        loss=dict(objective="clip"),
        model=dict(init_logit_scale=0.0, vision=dict(embed_unc=False, pool="gpo", size_augment=0.2),
                   text=dict(embed_unc=False, pool="gpo", pad_id=0)),
        targets=dict(positives="image_id"),
        optim="pcmepp", epochs=25),
}

# size=cpu: the tiny towers. PCME++ and PCME keep PCME++'s heads (`tiny_pcmepp`: the last block
# duplicated for log sigma^2, GPO, image SizeAugment 0.2, caption SizeAugment off as in
# PCMEPP_HEADS) with one CPU-size change: the log sigma^2 bias starts at -10 (ProLIP's [UNC]
# init) instead of PCME++'s 0, with which the tiny towers stay at chance (the paper recipes keep
# 0). DAA stays on ProLIP's [UNC] head; Pishdad keeps its duplicated projection; the
# deterministic baselines are mu-only. Measurements: docs/recipes.md, "caption_recipes size=cpu".
_MU_ONLY = {"vision": {"embed_unc": False}, "text": {"embed_unc": False, "pool": "last"}}
_TINY = ("tiny", {"vision": {}, "text": {}})
_TINY_PCMEPP = ("tiny_pcmepp", {"vision": {"init_unc_bias": -10.0},
                                "text": {"size_augment": 0.0, "init_unc_bias": -10.0}})
CPU_TOWERS = {"pcmepp": _TINY_PCMEPP, "pcme": _TINY_PCMEPP, "daa": _TINY,
              "pishdad": ("tiny_pishdad", {"vision": {}, "text": {}}),
              "vse": ("tiny", _MU_ONLY), "infonce": ("tiny", _MU_ONLY)}

# size=cpu: DAA's weight. PCME's terms are sums over the B x B pairs (DAA's
# criterions/probemb.py, reduction='sum') while DAA is a mean over queries, so at batch 32 the
# paper's 1000 (set for batch 128) weighs DAA 16x more against PCME; it is scaled by
# (32 / 128)^2 = 62.5 (at 1000 the random tiny towers collapse). Measurements: docs/recipes.md.
PAPER_DAA_BATCH = 128  # DAA's config/coco/pcme_coco.yaml batch, the one daa_beta 1000 was set for

EPOCH_KNOBS = {"unlock_epoch": "unlock_step", "unlock_warmup_epochs": "unlock_warmup_steps",
               "swa_start_epoch": "swa_start_step", "swa_every_epochs": "swa_every_steps",
               "warmup_epochs": "warmup_steps", "cosine_epochs": "cosine_steps"}


def _optim(recipe: dict) -> dict:
    o = recipe["optim"]
    return dict(RECIPES[o]["optim"]) if isinstance(o, str) else dict(o)


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    args = config_args.parse(arg, method="pcmepp", dataset="coco", size="paper", noise="0")
    method = args["method"]
    if method not in RECIPES:
        raise ValueError(f"unknown caption recipe method={method!r}; known: {sorted(RECIPES)}")
    dataset, size = args["dataset"], args["size"]
    if dataset not in EPOCH_CAPTIONS:
        raise ValueError(f"dataset={dataset!r} is not one of {sorted(EPOCH_CAPTIONS)}")
    if size not in ("paper", "cpu"):
        raise ValueError(f"size={size!r} is not 'paper' or 'cpu'")
    recipe, cpu = RECIPES[method], size == "cpu"
    batch = 32 if cpu else (150 if dataset == "cub" else 128)  # DAA's CUB batch: 150
    # cpu: about CPU_STEPS steps in all, the recipe's epochs (freeze, SWA, lr steps) scaled down.
    epoch = max(1, CPU_STEPS // recipe["epochs"]) if cpu else EPOCH_CAPTIONS[dataset] // batch

    c = mlc.ConfigDict()
    c.seed = 0
    c.batch_size = batch
    c.total_steps = recipe["epochs"] * epoch
    c.log_steps = 10 if cpu else 100
    c.checkpoint_steps = c.total_steps if cpu else epoch
    c.keep_checkpoints = 2

    model = {k: v for k, v in recipe["model"].items() if k not in ("vision", "text")}
    towers = {k: dict(recipe["model"].get(k, {})) for k in ("vision", "text")}
    variant = "open_clip:ViT-B-32-quickgelu"
    if cpu:  # the tiny towers with the same heads (prolip_jax/core/models/config.py VARIANTS)
        variant, towers = CPU_TOWERS[method]
    c.model = mlc.ConfigDict(dict(variant=variant, config_json="", dtype="float32", remat="none",
                                  attention_impl="auto", embed_dim=0 if cpu else EMBED_DIM, **model,
                                  vision=dict(towers["vision"]), text=dict(towers["text"])))

    loss = dict(recipe["loss"])
    if "sum_warmup_epochs" in loss:  # cpu: a third of the run, as benchmarks/methods_synthetic.py
        epochs = loss.pop("sum_warmup_epochs")
        loss["sum_warmup_steps"] = CPU_STEPS // 3 if cpu else epochs * epoch
    if cpu and "daa_beta" in loss:  # the PCME : DAA balance of batch 128 (see PAPER_DAA_BATCH)
        loss["daa_beta"] *= (batch / PAPER_DAA_BATCH) ** 2
    c.loss = mlc.ConfigDict(loss)
    c.targets = mlc.ConfigDict(dict(recipe["targets"]))
    if cpu:  # generated captions repeat across images (COCO's rarely do): identical ones are positives
        c.targets.positives = "both"

    o = _optim(recipe)
    for knob, field in EPOCH_KNOBS.items():
        if knob in o:
            o[field] = int(o.pop(knob) * epoch)
    o.setdefault("warmup_steps", 0)
    if cpu:  # from random towers: a short warm-up (the paper recipes start from CLIP)
        o.update(lr=2e-3, warmup_steps=20, groups=(), layer_decay=1.0, locked=(), unlock_step=0,
                 unlock_warmup_steps=0, unlock_warmup_form="lr")
    c.optim = mlc.ConfigDict(o)

    c.data = mlc.ConfigDict(dict(
        source={"coco": "coco_karpathy", "flickr30k": "flickr30k", "cub": "cub"}[dataset],
        caption_file="", image_root="", caption_iteration="per_caption",
        positive_level="class" if dataset == "cub" else "image", noise_ratio=float(args["noise"]),
        image_size=32 if cpu else 224, normalization="openai", image_dtype="uint8", num_workers=0 if cpu else 8,
        color_jitter_prob=0.0, grayscale_prob=0.0,
        tokenizer=dict(kind="hf" if cpu else "clip_bpe", path="", context_length=16 if cpu else 77),
    ))
    c.init = mlc.ConfigDict(dict(path="" if cpu else "timm/vit_base_patch32_clip_224.openai",
                                 fresh=() if cpu else NEW_PROJECTIONS))

    # Model selection by validation RSUM every epoch (PCME++ App. B.2; Pishdad et al. §4.2).
    if not cpu and dataset != "cub":
        c.evals = mlc.ConfigDict()
        c.evals.val = dict(type="retrieval", dataset="karpathy", name="val", split="val",
                           karpathy_json=c.data.get_ref("caption_file"), image_root=c.data.get_ref("image_root"),
                           scores=("csd",) if recipe["model"].get("vision", {}).get("embed_unc", True) else ("dot",),
                           log_steps=epoch)
        score = c.evals.val.scores[0]
        c.keep_best = mlc.ConfigDict(dict(metric=f"retrieval/val/{score}/1k/rsum" if dataset == "coco"
                                          else f"retrieval/val/{score}/rsum", mode="max", baseline=0.0))
    return c
