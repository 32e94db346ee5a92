r"""Pretrain a small ProLIP from scratch on your own image-caption data (tar shards or ArrayRecord).

Recipe: the ProLIP objective of "Probabilistic Language-Image Pre-Training" (Chun et al.) on a
small model, with loss weights for short runs (below). Hardware and time: `size=tiny` on 2 CPU
cores, 15-40 min; `size=small` is a GPU job (not timed here).

    python -m prolip_jax.train --config configs/own_data.py --workdir workdirs/mine \
        --config.data.path='/data/mine/train-{00000..00009}.tar' \
        --config.data.tokenizer.path=/data/mine/tokenizer.model

The whole recipe (shards, tokenizer, training, evaluation, export) is the README's "Your own
data" section. Data and tokenizer come from `--config.data.*` (every input_pipeline.DataConfig
field can be set): `data.path` (files, globs or a brace pattern), `data.source` (auto, the default:
tar or array_record from the names' ending; array_record files come from
scripts/tar_to_array_record.py), `data.tokenizer.path` (a SentencePiece
`.model`, e.g. from scripts/train_tokenizer.py; `data.tokenizer.kind=hf` for a tokenizer.json).
The tokenizer must fit the model: at most `vocab` ids (below) and its masking ids set:
`masking.mask_token_id` (the id that replaces masked text tokens: a [MASK] / unused piece the
tokenizer never emits) and `masking.protected_ids` (ids never masked: pad and EOS). The
defaults, 3 and (1,), are a SentencePiece model with <pad> 0, </s> 1 (pad = EOS, as ProLIP
pads), <unk> 2 and [MASK] 3: the layout of scripts/train_tokenizer.py's models (it prints
the flags); for another tokenizer pass `--config.masking.mask_token_id=...` and
`--config.masking.protected_ids='(...)'`.

Config args (`--config configs/own_data.py:size=small,steps=20000`):
    size=tiny    (default) the `tiny` variant: 32 px, patch 8, width 64, 2+2 layers, embed 64;
                 vocab <= 1,000, context 16, batch 128. Expected time for the default
                 5,000 steps: 15 min on 2 idle CPU cores, up to 40 min on busy ones.
    size=small   configs/models/own_data_small.json: 64 px, patch 8, width 256, 6+6 layers,
                 embed 256; vocab <= 8,000, context 32. Batch 256, 20,000 steps: a GPU job
                 (raise --config.data.num_workers there; its speed and loss curve were not
                 measured here). For the paper's B/16 see configs/prolip_b16_datacomp.py.
    steps=N      total steps (default 5,000 tiny / 20,000 small)
    zeroshot=DIR zero-shot accuracy during training on the ImageFolder DIR/val/<class>/*
                 (class names: the folder names), every 1/5 of the run, in metrics.jsonl and
                 TensorBoard. Final numbers: scripts/evaluate.py with configs/eval/imagefolder.py.

Loss weights: VIB beta 1e-3 and alpha_1 (image-in-text inclusion) 1e-3, not the paper's 1e-4
and 1e-7 (set for 1.28B samples): with the paper's the sigma^2 stay at their e^-10 initial value
in a short run and every uncertainty output shows the initialisation; with a VIB beta of 0.01
or more the means learn late (the loss stays flat for hundreds of steps). For a long run on a
large dataset the paper's values (`--config.loss.vib_beta=1e-4
--config.loss.alpha_image_text=1e-7`) apply. Why, and the figure this recipe reaches on a small
real set over seeds: docs/data.md and docs/recipes.md, "own_data".
"""
from pathlib import Path

import ml_collections as mlc

from prolip_jax.runtime import config_args

SIZES = {
    # variant / config_json, image px, context, batch, steps, lr, warm-up
    "tiny": dict(variant="tiny", config_json="", image_size=32, context_length=16, batch_size=128,
                 steps=5000, lr=2e-3, warmup_steps=200),
    "small": dict(variant="tiny", config_json=str(Path(__file__).parent / "models" / "own_data_small.json"),
                  image_size=64, context_length=32, batch_size=256, steps=20000, lr=1e-3, warmup_steps=500),
}
VIB_BETA = 1e-3     # the paper: 1e-4 (see the docstring)
ALPHA_IT = 1e-3     # the paper: 1e-7
MASK_TOKEN_ID = 3   # [MASK] of a SentencePiece model <pad> 0, </s> 1, <unk> 2, [MASK] 3
PROTECTED_IDS = (1,)  # pad = EOS = 1


def get_config(arg=None):
    args = config_args.parse(arg, size="tiny", steps="", zeroshot="")
    if args["size"] not in SIZES:
        raise ValueError(f"unknown size {args['size']!r}; known: {sorted(SIZES)}")
    s = SIZES[args["size"]]
    c = mlc.ConfigDict()
    c.seed = 0
    c.total_steps = int(args["steps"] or s["steps"])
    c.batch_size = s["batch_size"]  # global

    c.model = mlc.ConfigDict(dict(
        variant=s["variant"], config_json=s["config_json"],  # config_json, when set, wins
        dtype="float32", remat="none", attention_impl="auto",
        init_logit_scale=2.302585092994046,  # log 10: the paper's a = 10
    ))
    c.data = mlc.ConfigDict(dict(
        source="auto",  # tar or array_record, from the ending of data.path's names
        path="",        # --config.data.path='/data/mine/train-{00000..00009}.tar'
        image_size=s["image_size"], num_workers=0, augment=True,
        image_dtype="uint8",  # normalised on device: 4x less host work
        # kwargs of input_pipeline.tokenizers.build_tokenizer; --config.data.tokenizer.path=...
        tokenizer=dict(kind="sentencepiece", path="", context_length=s["context_length"]),
    ))
    c.loss = mlc.ConfigDict(dict(
        ppcl_weight=1.0, vib_beta=VIB_BETA, alpha_image_text=ALPHA_IT, alpha_masked=1e-3,
        inclusion_eps=-20.0, inclusion_scale=1000.0, vib_form="reference", ppcl_impl="dense",
    ))
    c.masking = mlc.ConfigDict(dict(
        fraction=0.125, group=8, image_keep_ratio=0.75, text_mask_prob=0.75,
        mask_token_id=MASK_TOKEN_ID, protected_ids=PROTECTED_IDS,
    ))
    c.optim = mlc.ConfigDict(dict(lr=s["lr"], warmup_steps=s["warmup_steps"], b1=0.9, b2=0.95, eps=1e-6,
                                  weight_decay=0.2, clip_norm=0.0, end_lr=0.0))
    c.microbatches = 1
    c.mesh = mlc.ConfigDict(dict(shape=(-1, 1, 1), axes=("data", "fsdp", "tensor")))
    c.sharding_rules = "replicated"
    c.log_steps = 100
    c.checkpoint_steps = 1000
    c.keep_checkpoints = 2
    c.max_nonfinite_in_a_row = 10
    c.evals = mlc.ConfigDict()
    if args["zeroshot"]:
        c.evals.zeroshot = mlc.ConfigDict(dict(
            type="zeroshot", dataset="imagefolder", root=args["zeroshot"], split="val",
            templates=("a photo of a {}.", "a picture of a {}.", "{}"),
            log_steps=max(1, c.total_steps // 5)))
        c.evals.zeroshot.tokenizer = c.data.tokenizer  # the same object: one override sets both
    return c
