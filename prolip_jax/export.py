"""The Hugging Face export of a model: weights, config, tokenizer and image preprocessing.

`save_hf` writes what the authors' `ProLIPHF.from_pretrained(folder)` loads (`config.json` +
`model.safetensors`, prolip_jax/core/convert.py's layout), plus the tokenizer the model was trained
with (input_pipeline/tokenizer_files.py) and a transformers `preprocessor_config.json`;
`load_hf_preprocessing` reads the last two back for `prolip_jax.load`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from input_pipeline import tokenizer_files
from prolip_jax.runtime import paths
from prolip_jax.runtime.paths import chmod_default
from prolip_jax.core import convert
from prolip_jax.core import normalization as normalization_lib
from prolip_jax.core.models.config import ProLIPConfig

PREPROCESSOR_NAME = "preprocessor_config.json"


def save_hf(hf_dir: str | os.PathLike, params: Mapping[str, Any], config: ProLIPConfig,
            overwrite: bool = False, tokenizer: Any = None, normalization: Any = None) -> Path:
    """Writes `config.json` + `model.safetensors` loadable by `ProLIPHF.from_pretrained(hf_dir)`.

    tokenizer: a `tokenizer_files.TokenizerFile` (the checkpoint's, `tokenizer_files.file_from_checkpoint`):
      written into the folder (its file, `prolip_tokenizer.json`, and a `tokenizer.json` +
      `tokenizer_config.json` for `AutoTokenizer`), and config.json's text_cfg then names the
      folder itself (`hf_tokenizer_name: "."`, `tokenizer_kwargs: {"clean": ...}`) instead of
      the model variant's default tokenizer (SigLIP's 32k vocabulary for a 1,000-row embedding).
    normalization: a name of prolip_jax.core.normalization.NORMALIZATIONS (the training's
      data.normalization) or a (mean, std) pair: written as `preprocessor_config.json`
      (transformers' CLIPImageProcessor: bicubic resize + centre crop + that mean/std).

    Everything is converted and checked first, then written into a temporary folder that is
    renamed into place, so a failure never leaves a half-written folder. Files and the folder get
    normal permissions (0644 / 0755 under the usual umask), not the temporary ones (0600 / 0700).
    """
    from safetensors.numpy import save_file  # here: only an export needs the writer

    hf_dir = Path(hf_dir)
    if hf_dir.exists() and any(hf_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{hf_dir} exists and is not empty (pass overwrite=True / --overwrite)")
    state_dict = convert.flax_to_torch(params, config)
    config_dict = config.without_training_options().to_dict()  # SizeAugment: no reference key
    with paths.replacing_folder(hf_dir) as tmp:
        tmp.mkdir()
        save_file(state_dict, str(tmp / convert.WEIGHTS_NAME), metadata={"format": "pt"})
        if tokenizer is not None:
            config_dict["text_cfg"].pop("hf_tokenizer_name", None)  # the variant's, not this model's
            config_dict["text_cfg"].pop("tokenizer_kwargs", None)
            config_dict["text_cfg"].update(tokenizer_files.write_hf_files(tmp, tokenizer))
        if normalization is not None:
            mean, std = normalization_lib.mean_std(normalization)
            (tmp / PREPROCESSOR_NAME).write_text(json.dumps(
                preprocessor_config(config.vision.image_size, mean, std), indent=2) + "\n")
        (tmp / convert.CONFIG_NAME).write_text(json.dumps(config_dict, indent=2) + "\n")
        # mkdtemp makes the folder 0700 and safetensors writes 0600: give them the modes of
        # ordinary files, or nobody else (a serving user, a shared group) can read the export.
        for f in tmp.iterdir():
            chmod_default(f)
        chmod_default(tmp)
    return hf_dir


def load_hf_preprocessing(hf_dir: str | os.PathLike) -> tuple[Any, Any]:
    """(the recorded tokenizer or None, the normalisation or None) of an exported folder:
    `prolip_tokenizer.json` and `preprocessor_config.json` as `save_hf` writes them. The
    normalisation is a NORMALIZATIONS name when the mean/std are one's, else a (mean, std) pair."""
    record = paths.join(hf_dir, tokenizer_files.RECORD_NAME)  # the path layer: a URL too
    tokenizer = (tokenizer_files.tokenizer_from_record(hf_dir, json.loads(paths.read_text(record)))
                 if paths.isfile(record) else None)
    normalization = None
    pre = paths.join(hf_dir, PREPROCESSOR_NAME)
    if paths.isfile(pre):
        cfg = json.loads(paths.read_text(pre))
        if "image_mean" in cfg and "image_std" in cfg:
            normalization = normalization_lib.name_of(cfg["image_mean"], cfg["image_std"])
    return tokenizer, normalization


def preprocessor_config(image_size: int, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    """`preprocessor_config.json` of an export: transformers' CLIPImageProcessor with the
    training's evaluation transform (bicubic shortest-side resize, centre crop) and
    normalisation; `prolip_jax.load(<folder>)` reads the mean/std back."""
    return {"image_processor_type": "CLIPImageProcessor", "do_convert_rgb": True,
            "do_resize": True, "size": {"shortest_edge": int(image_size)}, "resample": 3,
            "do_center_crop": True, "crop_size": {"height": int(image_size), "width": int(image_size)},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]}
