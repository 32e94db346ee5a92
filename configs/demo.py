r"""`make demo`: a small ProLIP pretrained on the demo dataset in minutes on 2 CPU cores.

    python scripts/demo.py                                   # what `make demo` runs (train + eval)
    python -m prolip_jax.train --config configs/demo.py --workdir workdirs/demo   # training only

Config args (`--config configs/demo.py:steps=1000`):
    steps=N     total training steps (default below)
    smoke=1     the CI smoke run: a small train split and a few hundred steps
    seed=N      the run's seed (initialisation, data order, masking; default 0): the headline
                figures' spread over seeds is measured by benchmarks/demo_spread.py

The demo dataset (input_pipeline/demo) is one coloured shape on a grey background with four
caption levels, "a shape" -> "a circle" -> "a red circle" -> "a small red circle in the top
left"; the trainer draws one level per image per epoch, so general captions are paired with
many images (the multiplicity ProLIP models, paper §1, §4.3). Held-out splits are scored by
scripts/evaluate.py with configs/eval/demo.py.

Recipe: the ProLIP objective of "Probabilistic Language-Image Pre-Training" (Chun et al.) at
demo size: the `tiny` model, batch 128, lr 2e-3, 6,000 steps, no random crop, captions weighted
1:1:2:8 over levels 0..3, VIB beta 0.1 and alpha_1 1e-3 instead of the paper's 1e-4 and 1e-7.
Expected time: the whole `make demo` (train + evaluation) about 13 min on 2 vCPUs, one CPU
device (docs/demo.md). Why each choice (the held-out measurements that made them):
docs/recipes.md, "demo".
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args

STEPS = 6000
SMOKE_STEPS = 300  # clears scripts/demo.py's SMOKE_TARGETS, the accuracies by ~2x (docs/recipes.md, "demo")
IMAGE_SIZE = 32
LEVEL_WEIGHTS = (1, 1, 2, 8)
VIB_BETA = 0.1
ALPHA_IT = 1e-3


def get_config(arg=None):
    args = config_args.parse(arg, steps="", smoke="0", seed="0")
    smoke = args["smoke"] == "1"
    c = mlc.ConfigDict()
    c.seed = int(args["seed"])
    c.total_steps = int(args["steps"] or (SMOKE_STEPS if smoke else STEPS))
    c.batch_size = 128

    c.model = mlc.ConfigDict(dict(
        variant="tiny",  # 32 px, patch 8, width 64, 2+2 layers, context 16 (prolip_jax.core.models.VARIANTS)
        config_json="", dtype="float32", remat="none", attention_impl="auto",
        init_logit_scale=2.302585092994046,  # log 10: the paper's a = 10
    ))
    # These fields (and the model's context length) are the dataset's cache key; scripts/demo.py
    # gives them to the configs/eval/demo.py evaluators, so training and evaluation share it.
    demo = dict(image_size=IMAGE_SIZE, num_train=2_000 if smoke else 20_000, level_weights=LEVEL_WEIGHTS)
    c.data = mlc.ConfigDict(dict(
        source="demo", path="", image_size=IMAGE_SIZE, num_workers=0, augment=True,
        crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
        image_dtype="uint8",  # normalised on device
        grayscale_prob=0.0,  # captions name colours: a grayscale image would contradict them
        demo=demo,
        tokenizer=dict(kind="sentencepiece", path="", context_length=16),  # demo: its own tokenizer
    ))
    c.loss = mlc.ConfigDict(dict(
        ppcl_weight=1.0, vib_beta=VIB_BETA, alpha_image_text=ALPHA_IT, alpha_masked=1e-3,
        inclusion_eps=-20.0, inclusion_scale=1000.0, vib_form="reference", ppcl_impl="dense",
    ))
    c.masking = mlc.ConfigDict(dict(
        fraction=0.125, group=8, image_keep_ratio=0.75, text_mask_prob=0.75,
        mask_token_id=2, protected_ids=(1,),  # the demo tokenizer: [MASK] = 2, pad = EOS = 1
    ))
    c.optim = mlc.ConfigDict(dict(lr=2e-3, warmup_steps=200, b1=0.9, b2=0.95, eps=1e-6,
                                  weight_decay=0.2, clip_norm=0.0, end_lr=0.0))
    c.microbatches = 1
    c.mesh = mlc.ConfigDict(dict(shape=(-1, 1, 1), axes=("data", "fsdp", "tensor")))
    c.sharding_rules = "replicated"
    c.log_steps = 50 if smoke else 100
    c.checkpoint_steps = 500
    c.keep_checkpoints = 2
    c.max_nonfinite_in_a_row = 10
    # Evaluated during training, every `log_steps` of their own: TensorBoard curves (five points;
    # the smoke run's two show that they are written). The final numbers come from
    # scripts/evaluate.py on the last checkpoint.
    eval_demo = dict(demo)
    every = c.total_steps // (2 if smoke else 5) or 1
    c.evals = mlc.ConfigDict()
    c.evals.zeroshot = dict(type="zeroshot", dataset="demo", task="object", demo=eval_demo,
                            log_steps=every)
    c.evals.retrieval = dict(type="retrieval", dataset="demo", demo=eval_demo, scores=("csd",),
                             log_steps=every)
    return c
