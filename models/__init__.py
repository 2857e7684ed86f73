"""A decoder-only MoE language model built on jax_kittens.nn, its configs, data and training loop."""
