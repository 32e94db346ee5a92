"""prolip_jax: probabilistic vision-language models (ProLIP) in JAX/Flax.

    import prolip_jax
    model = prolip_jax.load(path)             # CKPT dir or Hugging Face folder
    mu, logvar = model.encode_image(model.preprocess(pil_images))  # the training's resize/crop/normalisation
    mu, logvar = model.encode_text(model.tokenize(texts))          # the tokenizer recorded with it

The names below load on first use: `load` sits at the top of the house (it wires checkpoints,
tokenizers and image preprocessing together), and `import prolip_jax.<core module>` (what
input_pipeline's grain workers do) must not pull the whole API, and jax, in with it.
"""
import importlib

_LAZY = {
    "PretrainedProLIP": "prolip_jax.api",
    "load": "prolip_jax.api",
    "ProLIP": "prolip_jax.core.models",
    "ProLIPConfig": "prolip_jax.core.models",
    "get_config": "prolip_jax.core.models",
}

__version__ = "0.1.0"
__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prolip_jax' has no attribute {name!r}")
