r"""A tiny ProLIP on the demo dataset: a CPU run of the real trainer, pipeline and checkpoints.

Recipe: none of a paper's; the ProLIP objective of "Probabilistic Language-Image Pre-Training"
(Chun et al.) at smoke-test size, for tests, benchmarks and trying the trainer out.

    python -m prolip_jax.train --config configs/tiny.py --workdir /tmp/prolip_tiny

Config args (`--config configs/tiny.py:steps=50,data=random`):
    steps=N        total training steps (default 200)
    data=demo      the generated demo dataset (default; generated on first use, ~30 s)
    data=random    random images/tokens (no files at all: for smoke tests and benchmarks)
    size=micro     the `micro` towers (16 px, one block each, context 8, batch 16): a run of
                   the trainer whose model is not what is tested (the multi-process tests)

Any field can be overridden: `--config.batch_size=64 --config.optim.lr=1e-3`.
Expected run time on 2 CPU cores: about 0.2 s per step (8 fake devices) after a ~30-60 s compile.
For a TPU pod or a GPU cluster see configs/prolip_b16_datacomp.py and scripts/launch_*.sh
(`CONFIG=configs/tiny.py` works with them for a smoke test of the launch path).
"""
import ml_collections as mlc

from prolip_jax.runtime import config_args


def get_config(arg=None):
    args = config_args.parse(arg, steps="200", data="demo", size="tiny")
    if args["size"] not in ("tiny", "micro"):
        raise ValueError(f"size={args['size']!r} is not 'tiny' or 'micro'")
    c = mlc.ConfigDict()
    c.seed = 0
    c.total_steps = int(args["steps"])
    c.batch_size = 64  # global

    c.model = mlc.ConfigDict(dict(
        variant="tiny",  # a name in prolip_jax.core.models.VARIANTS (32 px, patch 8, context 16)
        config_json="",  # or a path to a reference config.json (any size), used instead
        dtype="float32", remat="none", attention_impl="auto",
        init_logit_scale=2.302585092994046,  # log 10: the paper's a = 10
    ))
    c.data = mlc.ConfigDict(dict(
        source=args["data"],  # demo | random | array_record | tar | tfds
        path="", image_size=32, num_workers=0, augment=True,
        image_dtype="uint8",  # normalised on device (OpenAI CLIP mean/std): 4x less host work
        grayscale_prob=0.0,  # demo captions name colours: a grayscale image would contradict them
        demo=dict(image_size=32, num_train=20_000),
        # For array_record/tar/tfds sources: kwargs of input_pipeline.tokenizers.build_tokenizer.
        tokenizer=dict(kind="sentencepiece", path="", context_length=16),
    ))
    c.loss = mlc.ConfigDict(dict(
        ppcl_weight=1.0, vib_beta=1e-4, alpha_image_text=1e-7, alpha_masked=1e-3,
        inclusion_eps=-20.0, inclusion_scale=1000.0, vib_form="reference", ppcl_impl="dense",
    ))
    c.masking = mlc.ConfigDict(dict(
        fraction=0.125, group=8, image_keep_ratio=0.75, text_mask_prob=0.75,
        mask_token_id=2, protected_ids=(1,),  # the demo tokenizer: [MASK] = 2, pad = EOS = 1
    ))
    c.optim = mlc.ConfigDict(dict(lr=1e-3, warmup_steps=20, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2,
                                  clip_norm=0.0, end_lr=0.0))
    c.microbatches = 1
    c.mesh = mlc.ConfigDict(dict(shape=(-1, 1, 1), axes=("data", "fsdp", "tensor")))
    c.sharding_rules = "replicated"
    c.log_steps = 10
    c.checkpoint_steps = 100
    c.keep_checkpoints = 2
    c.max_nonfinite_in_a_row = 10
    c.evals = mlc.ConfigDict()
    if args["size"] == "micro":  # VARIANTS["micro"]: 16 px, patch 8, context 8, vocabulary 64
        c.model.variant, c.model.attention_impl = "micro", "xla"
        c.batch_size, c.data.image_size, c.data.tokenizer.context_length = 16, 16, 8
        c.masking.group, c.masking.fraction = 2, 0.5  # masked sub-batches of 8 rows
    return c
