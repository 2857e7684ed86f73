"""jax_kittens: fused Mixture-of-Experts CUDA kernels for JAX through XLA FFI."""

from jax_kittens._extension import build_info
from jax_kittens.routing import Schedule, num_schedule_rows, route, routing_weights, schedule

__all__ = ["Schedule", "build_info", "num_schedule_rows", "route", "routing_weights", "schedule"]
__version__ = "0.1.0"
