"""ProLIP towers (Flax Linen) and model configuration."""
from prolip_jax.core.models.config import VARIANTS, ProLIPConfig, TextConfig, VisionConfig, get_config, with_overrides
from prolip_jax.core.models.prolip import (ProLIP, abstract_params, count_params, dummy_inputs, init_params,
                                      l2_normalize, mask_text_tokens, num_kept_patches,
                                      random_keep_indices)

__all__ = [
    "VARIANTS", "ProLIPConfig", "TextConfig", "VisionConfig", "get_config", "ProLIP", "abstract_params",
    "count_params", "dummy_inputs", "init_params", "l2_normalize", "mask_text_tokens",
    "num_kept_patches", "random_keep_indices", "with_overrides",
]
