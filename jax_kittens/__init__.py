"""jax_kittens: fused Mixture-of-Experts CUDA kernels for JAX through XLA FFI.

The Flax modules live in `jax_kittens.nn` (imported on its own, so the core needs no Flax).
"""

from jax_kittens import reference
from jax_kittens._extension import build_info
from jax_kittens.grouped_matmul import ragged_dot
from jax_kittens.moe import moe_ffn
from jax_kittens.moe_stats import MoEStats
from jax_kittens.routing import Schedule, num_schedule_rows, route, routing_weights, schedule
from jax_kittens.symmetric_heap import SymmetricHeap

__all__ = ["MoEStats", "Schedule", "SymmetricHeap", "build_info", "moe_ffn", "num_schedule_rows", "ragged_dot",
           "reference", "route", "routing_weights", "schedule"]
__version__ = "0.1.0"
