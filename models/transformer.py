"""`MoETransformer`: a decoder-only MoE language model in Flax NNX.

Pre-norm blocks: x + attention(rms_norm(x)), then x + ffn(rms_norm(x)) where ffn is a `jax_kittens.nn.nnx.MoE`
on MoE layers (config.moe_every) and a dense SwiGLU elsewhere. Causal multi-head attention with rotary position
embeddings; untied output head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_kittens import nn as kittens_nn
from jax_kittens.nn.moe_math import MoEAux
from models.configs import ModelConfig

_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def rotary(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding. x: [B, S, N, D] (D even) -> same shape; position = index along S."""
  seq_len, head_dim = x.shape[1], x.shape[3]
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [S, D/2]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary embeddings. qkv: [H, 3H], out: [H, H] (float32 params)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.qkv = nnx.Linear(config.hidden, 3 * config.hidden, use_bias=False, kernel_init=_INIT,
                          dtype=config.compute_dtype, rngs=rngs)
    self.out = nnx.Linear(config.hidden, config.hidden, use_bias=False, kernel_init=_INIT,
                          dtype=config.compute_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, S, H] -> [B, S, H]."""
    batch, seq_len, _ = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(batch, seq_len, 3 * self.config.num_heads, self.config.head_dim), 3,
                        axis=2)
    q, k = rotary(q, self.config.rope_base), rotary(k, self.config.rope_base)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.out(attended.reshape(batch, seq_len, self.config.hidden))


class DenseSwiGLU(nnx.Module):
  """(silu(x W_gate) * x W_up) W_down; gate, up: [H, dense_intermediate], down: [dense_intermediate, H]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    linear = dict(use_bias=False, kernel_init=_INIT, dtype=config.compute_dtype, rngs=rngs)
    self.gate = nnx.Linear(config.hidden, config.dense_intermediate, **linear)
    self.up = nnx.Linear(config.hidden, config.dense_intermediate, **linear)
    self.down = nnx.Linear(config.dense_intermediate, config.hidden, **linear)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def moe_config(config: ModelConfig, *, backend: str, axis_name: str | None) -> kittens_nn.MoEConfig:
  """The `MoEConfig` of the model's MoE layers."""
  return kittens_nn.MoEConfig(hidden=config.hidden, intermediate=config.expert_intermediate,
                              num_experts=config.num_experts, top_k=config.top_k, score=config.score,
                              shared_intermediate=config.shared_intermediate, axis_name=axis_name, backend=backend,
                              dtype=config.compute_dtype)


class Block(nnx.Module):
  """One pre-norm transformer block; ``ffn`` is an MoE or a dense SwiGLU."""

  def __init__(self, config: ModelConfig, layer: int, moe: kittens_nn.MoEConfig, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.hidden, dtype=config.compute_dtype, rngs=rngs)
    self.attention = Attention(config, rngs=rngs)
    self.ffn_norm = nnx.RMSNorm(config.hidden, dtype=config.compute_dtype, rngs=rngs)
    self.is_moe = config.is_moe_layer(layer)
    self.ffn = kittens_nn.nnx.MoE(moe, rngs=rngs) if self.is_moe else DenseSwiGLU(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux | None]:
    x = x + self.attention(self.attention_norm(x))
    if self.is_moe:
      y, aux = self.ffn(self.ffn_norm(x))
      return x + y.astype(x.dtype), aux
    return x + self.ffn(self.ffn_norm(x)), None


class MoETransformer(nnx.Module):
  """Decoder-only MoE LM. ``logits, aux = model(tokens)``: tokens [B, S] int32 -> logits [B, S, V] float32 and
  aux a list of one `MoEAux` per MoE layer.

  ``backend`` and ``axis_name`` go to every MoE layer (`jax_kittens.moe.moe_ffn`); with ``axis_name`` the model must
  run inside ``shard_map`` with the routed expert weights split over that axis.
  """

  def __init__(self, config: ModelConfig, *, backend: str = "auto", axis_name: str | None = None, rngs: nnx.Rngs):
    config.validate()
    self.config = config
    moe = moe_config(config, backend=backend, axis_name=axis_name)
    self.embed = nnx.Embed(config.vocab_size, config.hidden, embedding_init=nnx.initializers.normal(1.0),
                           dtype=config.compute_dtype, rngs=rngs)
    self.blocks = nnx.List([Block(config, layer, moe, rngs=rngs) for layer in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.hidden, dtype=config.compute_dtype, rngs=rngs)
    self.head = nnx.Linear(config.hidden, config.vocab_size, use_bias=False, kernel_init=_INIT,
                           dtype=config.compute_dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, list[MoEAux]]:
    # The byte vocabulary is small, so the lookup is a one-hot product: its gradient is a GEMM, where a gather's is a
    # scatter-add whose atomics pile onto ~260 rows (22 ms of the 57 ms `small` step on the H200, in both backends:
    # benchmarks/results/step_profile_h200.json at babd62c).
    dtype = self.config.compute_dtype
    one_hot = jax.nn.one_hot(tokens, self.config.vocab_size, dtype=dtype)
    x = jnp.dot(one_hot, self.embed.embedding[...].astype(dtype), precision=jax.lax.Precision.HIGHEST)
    aux = []
    for block in self.blocks:
      x, block_aux = block(x)
      if block_aux is not None:
        aux.append(block_aux)
    return self.head(self.final_norm(x)).astype(jnp.float32), aux
