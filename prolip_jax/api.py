"""`prolip_jax.load(path)`: a ready-to-use model from a CKPT directory or a Hugging Face folder.

    model = prolip_jax.load(path)
    mu, logvar = model.encode_image(model.preprocess(pil_images))   # or float32 [N, S, S, 3]
    mu, logvar = model.encode_text(model.tokenize(texts))           # or int32 [N, L]

`preprocess` is the training's evaluation transform: RGB, bicubic resize of the shorter side to
the model's image size S, centre crop S x S, pixels / 255, then (x - mean) / std with the
training's `data.normalization` (recorded in the checkpoint; "openai" = OpenAI CLIP's mean
(0.48145466, 0.4578275, 0.40821073) / std (0.26862954, 0.26130258, 0.27577711), the reference's;
"0.5" = SigLIP's 0.5 / 0.5). `tokenize` uses the tokenizer recorded with the checkpoint
(input_pipeline/tokenizer_files.py) or exported with a Hugging Face folder.

mu is L2-normalised and log sigma^2 raw, both float32 numpy [N, D]. `path` may also be a
Hugging Face repo id or any source `prolip_jax.core.pretrained.loader.load_pretrained` reads
(open_clip / OpenAI CLIP, timm or big_vision SigLIP): those deterministic models return
log sigma^2 = None. Encoding goes through
`prolip_jax.core.encode.Encoder`: fixed-size batches (any N compiles one shape per tower), split
over this host's devices.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from input_pipeline import tokenizer_files, transforms
from input_pipeline.decode import to_rgb
from input_pipeline.tokenizers import build_tokenizer
from prolip_jax.core import checkpoint, normalization as normalization_lib
from prolip_jax.core import convert, artifacts
from prolip_jax import export
from prolip_jax.runtime import overview
from evaluators import zeroshot
from prolip_jax.core.encode import Encoder
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.prolip import ProLIP
from prolip_jax.core.objectives.prolip.ppcl import ppcl_logits
from prolip_jax.core.pretrained.loader import load_pretrained


@dataclasses.dataclass
class PretrainedProLIP:
    config: ProLIPConfig
    params: Any
    dtype: Any = jnp.float32
    batch_size: int = 256
    step: int | None = None  # the checkpoint step it was loaded from (None: a Hugging Face folder)
    report: Any = None  # the ImportReport of an imported (non-prolip_jax) source
    tokenizer: Any = None  # the recorded tokenizer (input_pipeline.tokenizers), if any
    normalization: Any = "openai"  # a prolip_jax.core.normalization.NORMALIZATIONS name or a (mean, std) pair

    def __post_init__(self):
        self.module = ProLIP(self.config, dtype=self.dtype)
        self.encoder = Encoder(self.module, batch_size=self.batch_size)

    def summary(self) -> str:
        """The parameter table (names, shapes, sizes; clu.parameter_overview) with per-tower totals."""
        return overview.parameter_table(self.params)

    def __repr__(self) -> str:
        totals = overview.tower_totals(self.params)
        towers = ", ".join(f"{k} {v:,}" for k, v in totals.items())
        return (f"PretrainedProLIP({sum(totals.values()):,} parameters: {towers}; embed_dim={self.config.embed_dim}, "
                f"step={self.step}, dtype={jnp.dtype(self.dtype).name}; .summary() prints the parameter table)")

    @property
    def logit_scale(self) -> float:
        """log a, the learned parameter, as open_clip's `model.logit_scale` (a = `scale`)."""
        return float(self.params["logit_scale"])

    @property
    def scale(self) -> float:
        """a = exp(logit_scale), the factor of the match logits (`similarity`)."""
        return float(np.exp(self.params["logit_scale"]))

    @property
    def logit_bias(self) -> float:
        """b, the bias of the match logits."""
        return float(self.params["logit_bias"])

    def similarity(self, image: tuple[Any, Any], text: tuple[Any, Any]) -> np.ndarray:
        """Match logits [N, M] of N encoded images and M encoded texts ((mu, log sigma^2) pairs as
        `encode_image` / `encode_text` return them): the training's PPCL logit
        a (mu_v . mu_t - tr(S_v + S_t) / 2) + b = -(a / 2) CSD + a + b for unit mu ("Probabilistic
        Language-Image Pre-Training", eq. 2); sigmoid gives the match probability. A deterministic
        model (log sigma^2 None) scores a mu_v . mu_t + b."""
        (img_mu, img_logvar), (txt_mu, txt_logvar) = image, text
        img_mu, txt_mu = np.asarray(img_mu, np.float32), np.asarray(txt_mu, np.float32)
        if img_mu.ndim != 2 or txt_mu.ndim != 2 or img_mu.shape[1] != txt_mu.shape[1]:
            raise ValueError(f"similarity takes (mu [N, D], logvar) pairs of one width, got mu {img_mu.shape} "
                             f"and {txt_mu.shape}")
        none = lambda mu, lv: np.full_like(mu, -np.inf) if lv is None else np.asarray(lv, np.float32)  # exp -> 0
        return np.asarray(ppcl_logits(img_mu, none(img_mu, img_logvar), txt_mu, none(txt_mu, txt_logvar),
                                      self.scale, self.logit_bias))

    @staticmethod
    def uncertainty(embedding: tuple[Any, Any]) -> np.ndarray | None:
        """[N] the uncertainty of N encoded inputs ((mu, log sigma^2) of `encode_image` /
        `encode_text`): tr(S) = sum_d sigma_d^2, the paper's sigma^2 ("Probabilistic
        Language-Image Pre-Training", §4.3) and the evaluators' `sigma2_trace` (docs/metrics.md).
        None for a deterministic model."""
        logvar = embedding[1]
        return None if logvar is None else np.exp(np.asarray(logvar, np.float64)).sum(-1).astype(np.float32)

    def zero_shot(self, image: tuple[Any, Any], classnames: Sequence[str],
                  templates: Sequence[str] = ("a photo of a {}.",)) -> np.ndarray:
        """Class probabilities [N, C] of N encoded images ((mu, log sigma^2) of `encode_image`):
        each class's prompts (every template filled with its name) are encoded with the recorded
        tokenizer and averaged (mu renormalised, sigma^2 averaged), then scored as the zero-shot
        evaluator does, 100 mu_v . mu_c - 50 tr(S_c) (evaluators/zeroshot.py; the dot product alone
        for a deterministic model), and normalised with a softmax over the classes."""
        if isinstance(classnames, str) or not len(classnames):
            raise ValueError("classnames must be a non-empty list of class names")
        text_mu, text_logvar = self.encode_text(self.tokenize(zeroshot.prompts(classnames, templates)))
        n, t = len(classnames), len(templates)
        if text_logvar is None:
            class_mu, _ = zeroshot.class_embeddings(text_mu, np.zeros_like(text_mu), n, t)
            logits = zeroshot.zeroshot_logits(np.asarray(image[0]), class_mu, kind="dot")
        else:
            class_mu, class_sigma2 = zeroshot.class_embeddings(text_mu, text_logvar, n, t)
            logits = zeroshot.zeroshot_logits(np.asarray(image[0]), class_mu, class_sigma2, kind="csd")
        logits = logits - logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        return (probs / probs.sum(-1, keepdims=True)).astype(np.float32)

    def encode_image(self, images: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """images float [N, H, W, 3] (normalised) -> (mu [N, D] unit-norm, log sigma^2 [N, D] or None)."""
        images = np.asarray(images)
        s = self.config.vision.image_size
        if images.ndim != 4 or images.shape[1:] != (s, s, 3):
            raise ValueError(f"images must be [N, {s}, {s}, 3] (NHWC, normalised), got {images.shape}")
        if not np.issubdtype(images.dtype, np.floating):
            raise ValueError(f"images must be floating point (already normalised), got {images.dtype}")
        return self.encoder.images(self.params, images.astype(np.float32))

    def encode_text(self, token_ids: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """token_ids int [N, L], L <= context_length -> (mu [N, D] unit-norm, log sigma^2 [N, D] or None)."""
        tokens = np.asarray(token_ids)
        t = self.config.text
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= t.context_length:
            raise ValueError(f"token_ids must be [N, L] with 0 < L <= {t.context_length}, got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= t.vocab_size):
            raise ValueError(f"token ids must lie in [0, {t.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        return self.encoder.texts(self.params, tokens.astype(np.int32))


    def preprocess(self, images: Any) -> np.ndarray:
        """PIL images (any mode and size; or one image) -> float32 [N, S, S, 3] for encode_image:
        RGB, bicubic resize of the shorter side to S = the model's image size, centre crop,
        / 255, then (x - mean) / std of `self.normalization` (the training's data.normalization;
        "openai": mean (0.48145466, 0.4578275, 0.40821073), std (0.26862954, 0.26130258,
        0.27577711); "0.5": 0.5 / 0.5). The same transform the evaluators and the input
        pipeline's eval path apply (input_pipeline.transforms.eval_transform, then
        prolip_jax.core.normalization.normalize)."""
        if isinstance(images, Image.Image):
            images = [images]
        s = self.config.vision.image_size
        pixels = np.stack([transforms.eval_transform(_rgb(img), s) for img in images]) if len(images) else (
            np.zeros((0, s, s, 3), np.uint8))
        return normalization_lib.normalize(pixels, self.normalization)

    def tokenize(self, texts: Any) -> np.ndarray:
        """texts (a string or N strings) -> int32 [N, L] with the model's recorded tokenizer
        (cleaning, EOS and padding as in training; L = the training's context length)."""
        if self.tokenizer is None:
            raise ValueError(
                "this model carries no tokenizer (a checkpoint written before tokenizers were recorded, "
                "an imported model, or a folder exported without one): pass one to "
                "prolip_jax.load(path, tokenizer=dict(kind=..., path=...)) (input_pipeline.tokenizers"
                f".build_tokenizer kwargs; config.json names {self.config.text.hf_tokenizer_name!r})")
        return np.asarray(self.tokenizer(texts), np.int32)


def _rgb(img: Any) -> Any:
    """A PIL image as RGB (transparency composited on white, as input_pipeline.decode does)."""
    out = to_rgb(img)
    if not hasattr(out, "mode"):  # a Skip: a mode PIL cannot convert
        raise ValueError(f"cannot convert a {img.mode!r} image to RGB")
    return out


def _tokenizer_arg(tokenizer: Any, context_length: int) -> Any:
    """load(tokenizer=...): a tokenizer object, or build_tokenizer kwargs (dict(kind, path, ...))."""
    if tokenizer is None or callable(tokenizer):
        return tokenizer
    kw = dict(tokenizer)
    kw.setdefault("context_length", context_length)
    return build_tokenizer(**kw)


def load(path: str | os.PathLike, dtype: Any = jnp.float32, step: int | None = None,
         batch_size: int = 256, format: str = "auto", arch: Any = None, tokenizer: Any = None,
         normalization: Any = None) -> PretrainedProLIP:
    """Loads a prolip_jax checkpoint directory (CKPT), one of its step folders, a training
    workdir (its `checkpoints/` folder; the latest step unless `step` is given) or a Hugging Face
    folder (config.json + model.safetensors, e.g. a downloaded
    `SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B`): prolip_jax.core.artifacts.locate, the rule of every
    tool. A missing path is a one-line FileNotFoundError; only a missing `org/name` is tried on
    the hub.

    Anything else goes through `load_pretrained(path, format, arch)`: a Hugging Face repo id
    (downloaded, or read from the hub cache with HF_HUB_OFFLINE=1), open_clip / timm
    safetensors, a big_vision .npz.

    The model's `tokenizer` (for `.tokenize`) is the one recorded with the checkpoint or written
    into the exported folder; `tokenizer=` overrides it (a tokenizer, or build_tokenizer kwargs
    such as dict(kind="sentencepiece", path="spiece.model")). `normalization` (for
    `.preprocess`): default the training's data.normalization, else "openai" (the reference's;
    imported SigLIP models want "0.5")."""
    where = artifacts.locate(path, step)  # the one rule of every tool (prolip_jax/core/artifacts.py)
    report = None
    if where.kind in ("hub", "other") or format != "auto" or arch is not None:
        source = where.step_dir if where.kind == "checkpoint" else where.path
        try:
            config, params, report = load_pretrained(source, format=format, arch=arch)
        except FileNotFoundError as e:
            if where.kind != "other":
                raise
            raise FileNotFoundError(
                f"{path} is neither a prolip_jax checkpoint (<step>/params + <step>/config), a training "
                f"workdir (checkpoints/<step>/...), a Hugging Face folder ({convert.CONFIG_NAME} + "
                f"{convert.WEIGHTS_NAME}), nor weights of another family ({e})") from e
        params = jax.device_put(params)
        step = None
        recorded, recorded_norm = None, None  # other families: pass tokenizer= / normalization=
    elif where.kind == "hf":
        params, config = convert.load_hf(where.path)
        params = jax.device_put(params)
        step = None
        recorded, recorded_norm = export.load_hf_preprocessing(where.path)
    else:
        params, config, step = checkpoint.load_params(where.path, step=where.step)
        recorded = tokenizer_files.from_checkpoint(where.path, step=step)
        recorded_norm = checkpoint.training_normalization(checkpoint.load_config(where.path, step)[1])
    return PretrainedProLIP(config, params, dtype=dtype, batch_size=batch_size, step=step, report=report,
                            tokenizer=_tokenizer_arg(tokenizer, config.text.context_length) or recorded,
                            normalization=normalization or recorded_norm or "openai")
