"""Model configurations of the MoE language model (`models.transformer.MoETransformer`).

tiny: CPU, trains in minutes. small: one GPU. <shape>-geom: MoE layers with the H, I and top_k of the four model
shapes in design.md (kimi-k2, glm-5, qwen3.5, deepseek-v4) at reduced depth and expert count, for one GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and training hyper-parameters; `validate` raises ValueError naming the bad field.

  vocab_size: token ids (256 bytes + specials, see models.data). hidden: H. num_layers, num_heads (head dim =
  hidden / num_heads, even for rotary). moe_every: layer l is MoE when (l + 1) % moe_every == 0, dense SwiGLU
  (width dense_intermediate) otherwise. num_experts, top_k, expert_intermediate (I), shared_intermediate (Is or
  None), score ("softmax" | "sigmoid"), bias_update_rate (sigmoid: DeepSeek-V3 aux-loss-free step per update).
  load_balancing_weight, router_z_weight: coefficients of the aux losses in the training loss.
  seq_len, batch_size (global sequences per step), steps, warmup_steps, learning_rate, weight_decay, eval_every,
  eval_batches. dtype: "float32" | "bfloat16" | "auto", compute dtype (params stay float32); "auto" is bfloat16 on a
  GPU, where the kittens kernels (bf16 only) run the MoE layers, and float32 elsewhere.
  """

  name: str
  vocab_size: int = 260
  hidden: int = 128
  num_layers: int = 2
  num_heads: int = 4
  moe_every: int = 1
  dense_intermediate: int = 256
  num_experts: int = 8
  top_k: int = 2
  expert_intermediate: int = 128
  shared_intermediate: int | None = None
  score: str = "softmax"
  bias_update_rate: float = 1e-3
  load_balancing_weight: float = 1e-2
  router_z_weight: float = 1e-3
  rope_base: float = 10000.0
  seq_len: int = 128
  batch_size: int = 16
  steps: int = 500
  warmup_steps: int = 50
  learning_rate: float = 3e-3
  weight_decay: float = 0.1
  eval_every: int = 100
  eval_batches: int = 4
  dtype: str = "float32"

  @property
  def head_dim(self) -> int:
    return self.hidden // self.num_heads

  @property
  def compute_dtype(self):
    if self.dtype == "auto":
      return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    return jnp.dtype(self.dtype)

  def is_moe_layer(self, layer: int) -> bool:
    return (layer + 1) % self.moe_every == 0

  def validate(self) -> ModelConfig:
    positive = ("vocab_size", "hidden", "num_layers", "num_heads", "moe_every", "dense_intermediate", "num_experts",
                "top_k", "expert_intermediate", "seq_len", "batch_size", "steps", "eval_every", "eval_batches")
    for field in positive:
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config {self.name!r}: {field} must be a positive int, got {value!r}")
    if self.hidden % self.num_heads:
      raise ValueError(f"config {self.name!r}: num_heads={self.num_heads} must divide hidden={self.hidden}")
    if self.head_dim % 2:
      raise ValueError(f"config {self.name!r}: head_dim = hidden / num_heads = {self.head_dim} must be even (rotary)")
    if self.top_k > self.num_experts:
      raise ValueError(f"config {self.name!r}: top_k={self.top_k} must be <= num_experts={self.num_experts}")
    if self.moe_every > self.num_layers:
      raise ValueError(f"config {self.name!r}: moe_every={self.moe_every} > num_layers={self.num_layers} "
                       "leaves no MoE layer")
    if self.score not in SCORES:
      raise ValueError(f"config {self.name!r}: score must be one of {SCORES}, got {self.score!r}")
    if self.shared_intermediate is not None and self.shared_intermediate < 1:
      raise ValueError(f"config {self.name!r}: shared_intermediate must be positive or None")
    if self.vocab_size < 256:
      raise ValueError(f"config {self.name!r}: vocab_size={self.vocab_size} must cover the 256 byte values")
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"config {self.name!r}: warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
    if not self.learning_rate > 0:
      raise ValueError(f"config {self.name!r}: learning_rate must be > 0, got {self.learning_rate}")
    if self.dtype not in ("float32", "bfloat16", "auto"):
      raise ValueError(f"config {self.name!r}: dtype must be 'float32', 'bfloat16' or 'auto', got {self.dtype!r}")
    return self


def _geometry(name, hidden, intermediate, top_k, num_experts):
  """A model whose MoE layers have one design.md shape's H, I, top_k: 2 layers, few experts, one GPU, bf16."""
  return ModelConfig(name=name, hidden=hidden, num_layers=2, num_heads=hidden // 128, dense_intermediate=4 * hidden,
                     num_experts=num_experts, top_k=top_k, expert_intermediate=intermediate, seq_len=512,
                     batch_size=16, steps=200, warmup_steps=20, learning_rate=1e-3, eval_every=100, eval_batches=2,
                     dtype="bfloat16")


CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", batch_size=8, steps=200, warmup_steps=20, eval_every=50, dtype="auto"),
    "small": ModelConfig(name="small", hidden=512, num_layers=4, num_heads=8, dense_intermediate=2048,
                         num_experts=16, top_k=2, expert_intermediate=512, shared_intermediate=512, seq_len=512,
                         batch_size=32, steps=2000, warmup_steps=100, learning_rate=1e-3, eval_every=250,
                         dtype="bfloat16"),
    "kimi-k2-geom": _geometry("kimi-k2-geom", 7168, 2048, 8, 16),
    "glm-5-geom": _geometry("glm-5-geom", 6144, 2048, 8, 16),
    "qwen3.5-geom": _geometry("qwen3.5-geom", 4096, 1024, 10, 32),
    "deepseek-v4-geom": _geometry("deepseek-v4-geom", 7168, 3072, 6, 16),
}


def get_config(name: str, **overrides) -> ModelConfig:
  """The named config with ``overrides`` replaced, validated (ValueError for unknown names or bad values)."""
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}")
  config = CONFIGS[name]
  unknown = set(overrides) - {field.name for field in dataclasses.fields(ModelConfig)}
  if unknown:
    raise ValueError(f"unknown config fields {sorted(unknown)}")
  return dataclasses.replace(config, **overrides).validate()
