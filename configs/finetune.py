r"""Fine-tuning recipes: a ProLIP started from released CLIP, SigLIP or ProLIP weights.

Paper: "Probabilistic Language-Image Pre-Training" (Chun et al.; "ProLIP"), App. B.2 (the
SigLIP warm starts); `long` follows the authors' LongProLIP recipe.

Each recipe is the paper's pretraining config (configs/prolip_b16_datacomp.py) with a warm start
(`config.init`, prolip_jax/core/pretrained/warm_start.py) and the recipe's optimiser and loss. The
weights are read from a local file/folder or a Hugging Face repo id (downloaded once into the
hub cache; `HF_HUB_OFFLINE=1` reads only the cache). Data and tokenizer come on the command line
as for pretraining:
    --config.data.path='/data/shards/{00000..00999}.tar' --config.data.tokenizer.path=spiece.model

Recipes (`--config configs/finetune.py:recipe=NAME`); times are estimates scaled from the
reference's 1.5 days for 1.28B samples at B/16 on 32 H100s, not measurements:

siglip_l16     ProLIP L/16 (256 px) from SigLIP L/16-256 (`timm/ViT-L-16-SigLIP-256`), paper B.2:
               lr 5e-5, wd 0, 1.28B samples at batch 16,384; SigLIP's 0.5 normalisation and
               SentencePiece vocabulary (spiece.model of the same repo). ~6 days on 32 H100s.
siglip_so400m  ProLIP So400m/14 from SigLIP So400m/14 (`timm/ViT-SO400M-14-SigLIP`), the same
               schedule. ~8 days on 32 H100s.
dfn_h14        ProLIP H/14 from DFN CLIP H/14 (`apple/DFN5B-CLIP-ViT-H-14`), the same schedule,
               OpenAI normalisation and CLIP BPE vocabulary (bpe_simple_vocab_16e6.txt.gz,
               `--config.data.tokenizer.path=...`). ~12 days on 32 H100s.
long           LongProLIP: B/16 with a 256-token context from ProLIP B/16
               (`SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B`; text positions resized the
               LongProLIP way), the reference's longprolip_32h100.sh: lr 1e-6, wd 0.01, 200
               warm-up steps, batch 8,192, 32 x 8M samples, inclusion eps -100 and c 10, on
               long-caption data. ~0.5 day on 32 H100s.
own_data       The common case: a released ProLIP B/16 fine-tuned on your own image-text tar
               shards: lr 1e-5, 500 warm-up steps, 5,000 steps at batch 4,096 (20M samples).
               ~2 h on 8 H100s.

Override the source with `--config.init.path=...` (e.g. a local copy), lock the image tower with
`--config.optim.locked="('^visual/',)"`, and set per-group learning rates, layer-wise decay or an
unlock step as prolip_jax/core/optim.py describes.

TPU pod for siglip_l16, siglip_so400m and dfn_h14: a v5p-128 (64 chips, 256 per chip at the
batch of 16,384), FSDP over all chips, scanned blocks, remat `dots_no_batch`, compiled at full
depth (benchmarks/compile_tpu.py --topology v5p-128 --config configs/finetune.py:recipe=NAME):
56.0 / 66.6 / 75.5 GiB of HBM per chip of 95.7. On a v4-256 (128 chips, 30.75 GiB each) add
--config.model.remat=full: 6.6 / 7.7 / 10.2 GiB (dots_no_batch leaves L/16 under 10% free and
does not fit the others). docs/performance.md, "TPU pods, compiled ahead of time", has the rows
and their commands.

GPU cluster (SLURM) or TPU pod, from the repository root (settings: --help, docs/launch.md):
    CONFIG=configs/finetune.py:recipe=siglip_l16 bash scripts/launch_slurm.sh submit
    CONFIG=configs/finetune.py:recipe=siglip_l16 bash scripts/launch_tpu_pod.sh launch
One host:
    python -m prolip_jax.train --config configs/finetune.py:recipe=own_data --workdir WORKDIR \
        --config.data.path='/data/mine/{0000..0099}.tar' --config.data.tokenizer.path=spiece.model
"""
from pathlib import Path

from prolip_jax.runtime import config_args
from prolip_jax.core.pretrained import warm_start

# The large towers' remat on their v5p-128 (256 per chip): the matmul outputs kept, the rest
# recomputed. Of the policies compiled to fit with >= 10% of the HBM free, the one that
# recomputes least ("full" recomputes every block's forward; docstring above).
_V5P_REMAT = "dots_no_batch"

# recipe -> (model variant, warm-start source, data/optimiser/loss settings)
RECIPES = {
    "siglip_l16": dict(variant="L/16", init="timm/ViT-L-16-SigLIP-256", normalization="0.5",
                       lr=5e-5, weight_decay=0.0, warmup_steps=2_000, batch_size=16_384, samples=1_280_000_000,
                       remat=_V5P_REMAT),
    # SigLIP So400m/14 has a 16-token context: all 16 rows are interpolated to ProLIP's 64.
    "siglip_so400m": dict(variant="So400m/14", init="timm/ViT-SO400M-14-SigLIP", normalization="0.5",
                          lr=5e-5, weight_decay=0.0, warmup_steps=2_000, batch_size=16_384, samples=1_280_000_000,
                          text_pos_keep=0, remat=_V5P_REMAT),
    "dfn_h14": dict(variant="H/14", init="apple/DFN5B-CLIP-ViT-H-14", normalization="openai",
                    lr=5e-5, weight_decay=0.0, warmup_steps=2_000, batch_size=16_384, samples=1_280_000_000,
                    remat=_V5P_REMAT),
    "long": dict(variant="B/16-long", init="SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B", normalization="openai",
                 lr=1e-6, weight_decay=0.01, warmup_steps=200, batch_size=8_192, samples=32 * 8_000_000,
                 inclusion_eps=-100.0, inclusion_scale=10.0, context_length=256),
    "own_data": dict(variant="B/16", init="SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B", normalization="openai",
                     lr=1e-5, weight_decay=0.2, warmup_steps=500, batch_size=4_096, samples=5_000 * 4_096),
}


def get_config(arg=None):
    args = config_args.parse(arg, recipe="own_data")
    if args["recipe"] not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {args['recipe']!r}")
    r = RECIPES[args["recipe"]]
    # The pretraining config of the same size (B/16-long is B/16 with a longer text context).
    base_variant = "B/16" if r["variant"] == "B/16-long" else r["variant"]
    c = config_args.load_config_file(f"{Path(__file__).with_name('prolip_b16_datacomp.py')}:variant={base_variant}")
    c.model.variant = r["variant"]
    c.model.remat = r.get("remat", c.model.remat)
    c.batch_size = r["batch_size"]
    c.total_steps = r["samples"] // r["batch_size"]
    c.data.normalization = r["normalization"]
    if "context_length" in r:
        c.data.tokenizer.context_length = r["context_length"]
    c.optim.update(dict(lr=r["lr"], weight_decay=r["weight_decay"], warmup_steps=r["warmup_steps"]))
    c.loss.inclusion_eps = r.get("inclusion_eps", c.loss.inclusion_eps)
    c.loss.inclusion_scale = r.get("inclusion_scale", c.loss.inclusion_scale)
    c.checkpoint_steps = min(c.checkpoint_steps, max(c.total_steps // 10, 100))
    c.init = dict(warm_start.DEFAULTS, path=r["init"])  # the other knobs: see warm_start.DEFAULTS
    c.init.text_pos_keep = r.get("text_pos_keep", c.init.text_pos_keep)
    return c
