r"""The paper's recipe: ProLIP on DataComp-1B (§4.1, App. B.1; naver-ai/prolip scripts/*.sh and src/prolip_train/params.py).

Paper: "Probabilistic Language-Image Pre-Training" (Chun et al.; "ProLIP").

Global batch 16,384, AdamW lr 5e-4 (betas 0.9/0.95, eps 1e-6, wd 0.2), 10k warm-up then
cosine, 1.28B samples seen (78,125 steps), alpha1 1e-7, alpha2 1e-3, beta 1e-4, eps -20,
c 1000, 12.5% of each batch masked (images keep 75% of patches, 75% of text tokens masked).

Config args (`--config configs/prolip_b16_datacomp.py:variant=L/16,samples=12.8B`):
    variant=B/16 | L/16 | So400m/14 | H/14     (default B/16)
    samples=1.28B | 12.8B                       (default 1.28B)

Data: img2dataset webdataset shards and the SigLIP c4-en SentencePiece model (spiece.model
from the `timm/ViT-B-16-SigLIP` Hugging Face repo), both given on the command line:
    --config.data.path='gs://bucket/datacomp/{00000000..00139999}.tar'
    --config.data.tokenizer.path=/path/to/spiece.model
(or convert the shards once with scripts/tar_to_array_record.py and use
`--config.data.source=array_record --config.data.path='/data/datacomp/*.array_record'` for an
exactly resumable global shuffle).

TPU pod (v4-256, 128 chips: 128 samples/chip), from your workstation:
    bash scripts/launch_tpu_pod.sh launch   # settings: --help, docs/launch.md; runs on every worker:
    python -m prolip_jax.train --config configs/prolip_b16_datacomp.py --workdir gs://bucket/prolip_b16 \
        --config.data.path=... --config.data.tokenizer.path=...
GPU cluster (SLURM, 4 nodes x 8 H100, 512 samples/GPU as the reference's 32 GPUs):
    bash scripts/launch_slurm.sh submit   # srun python -m prolip_jax.train --config configs/prolip_b16_datacomp.py ...
Expected time (reference: 32 H100s): about 1.5 days for 1.28B samples seen at B/16.
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args

_SAMPLES = {"1.28B": 1_280_000_000, "12.8B": 12_800_000_000}
# Image size, sharding and memory layout per variant. ViTs from L/16 up shard parameters (FSDP),
# scan their blocks and rematerialise them in full: at batch 16,384 on the v4-256 named above
# (128 chips) L/16, So400m/14 and H/14 then need 6.6 / 7.7 / 10.2 GiB of HBM per chip of 30.75,
# compiled at full depth (benchmarks/compile_tpu.py; docs/performance.md "TPU pods"); the cheaper
# remat dots_no_batch leaves L/16 under 10% of the HBM free and does not fit the others there.
# (On a v5p-128 it fits all three: configs/finetune.py.) B/16 stays unrolled without remat:
# scanned it needed 33.4 GiB on a v4 chip.
_LARGE = dict(mesh=(1, -1, 1), rules="fsdp", scan_layers=True, remat="full")
_VARIANTS = {
    "B/16": dict(image_size=224, context_length=64, mesh=(-1, 1, 1), rules="replicated", scan_layers=False,
                 remat="none"),
    "L/16": dict(image_size=256, context_length=64, **_LARGE),
    "So400m/14": dict(image_size=224, context_length=64, **_LARGE),
    "H/14": dict(image_size=224, context_length=77, **_LARGE),
}


def _args(arg):
    out = config_args.parse(arg, variant="B/16", samples="1.28B")
    if out["variant"] not in _VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_VARIANTS)}, got {out['variant']!r}")
    if out["samples"] not in _SAMPLES:
        raise ValueError(f"samples must be one of {sorted(_SAMPLES)}, got {out['samples']!r}")
    return out


def get_config(arg=None):
    args = _args(arg)
    v = _VARIANTS[args["variant"]]
    c = mlc.ConfigDict()
    c.seed = 0
    c.batch_size = 16_384
    c.total_steps = _SAMPLES[args["samples"]] // c.batch_size  # 78,125 or 781,250

    c.model = mlc.ConfigDict(dict(
        variant=args["variant"], config_json="",
        dtype="bfloat16",  # float32 parameters, bfloat16 compute (the reference's amp_bf16)
        remat=v["remat"],  # "dots" or "full" trade compute for activation memory
        scan_layers=v["scan_layers"],  # one nn.scan per tower: compile time and memory of one block
        attention_impl="auto",  # cuDNN flash attention on GPU, XLA elsewhere
        init_logit_scale=2.302585092994046,  # the paper's a = 10 (the reference code: 1/0.07)
    ))
    clip_bpe = args["variant"] == "H/14"
    c.data = mlc.ConfigDict(dict(
        source="tar", path="",  # required: see the docstring
        image_size=v["image_size"], num_workers=16, per_worker_buffer_size=2, shuffle_buffer_size=10_000,
        augment=True, normalization="openai",
        image_dtype="uint8",  # normalised on device: ~1.6x faster input (input_pipeline/BENCHMARK.md)
        demo=dict(),
        tokenizer=dict(kind="clip_bpe" if clip_bpe else "sentencepiece", path="",
                       context_length=v["context_length"]),
    ))
    c.loss = mlc.ConfigDict(dict(
        ppcl_weight=1.0, vib_beta=1e-4, alpha_image_text=1e-7, alpha_masked=1e-3,
        inclusion_eps=-20.0, inclusion_scale=1000.0, vib_form="reference",
        ppcl_impl="ring",  # O(b_local^2) memory per device; "dense" gives the same value
    ))
    c.masking = mlc.ConfigDict(dict(
        fraction=0.125, group=8, image_keep_ratio=0.75, text_mask_prob=0.75,
        # SigLIP vocab: [MASK] = 32000 (<extra_id_99>), pad = EOS = 1. The CLIP BPE vocab of H/14
        # has no mask token; 49405 is a rarely used BPE merge, and pad/SOT/EOT stay protected.
        mask_token_id=49405 if clip_bpe else 32000,
        protected_ids=(0, 49406, 49407) if clip_bpe else (1,),
    ))
    c.optim = mlc.ConfigDict(dict(lr=5e-4, warmup_steps=10_000, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2,
                                  clip_norm=0.0, end_lr=0.0))
    c.microbatches = 1
    c.mesh = mlc.ConfigDict(dict(shape=v["mesh"], axes=("data", "fsdp", "tensor")))
    c.sharding_rules = v["rules"]
    c.log_steps = 100
    c.checkpoint_steps = 2_000
    c.keep_checkpoints = 3
    c.max_nonfinite_in_a_row = 20
    c.evals = mlc.ConfigDict()
    return c
