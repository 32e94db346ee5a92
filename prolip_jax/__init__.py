"""prolip_jax: probabilistic vision-language models (ProLIP) in JAX/Flax.

    import prolip_jax
    model = prolip_jax.load(path)             # CKPT dir or Hugging Face folder
    mu, logvar = model.encode_image(model.preprocess(pil_images))  # the training's resize/crop/normalisation
    mu, logvar = model.encode_text(model.tokenize(texts))          # the tokenizer recorded with it
"""
from prolip_jax.api import PretrainedProLIP, load
from prolip_jax.models import ProLIP, ProLIPConfig, get_config

__version__ = "0.1.0"
__all__ = ["PretrainedProLIP", "load", "ProLIP", "ProLIPConfig", "get_config", "__version__"]
