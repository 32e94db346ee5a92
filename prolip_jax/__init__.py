"""prolip_jax: probabilistic vision-language models (ProLIP) in JAX/Flax."""
