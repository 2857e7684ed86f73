"""Trace-time argument checks shared by the public ops: each raises a TypeError or ValueError naming the argument."""

from __future__ import annotations

import jax.numpy as jnp


def check_array(name: str, x, ndim: int | None, dtypes=None, shape: str | None = None) -> tuple[int, ...]:
  """x's shape, after checking that x is an array with ``ndim`` dims (None: any) and, when given, one of ``dtypes``.

  shape: how the error names the expected shape (e.g. "[tokens, hidden]"); by default its number of dims.
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if ndim is not None and x.ndim != ndim:
    expected = f"shape {shape}" if shape else f"{ndim} dims"
    raise ValueError(f"{name} must have {expected}, got shape {tuple(x.shape)}")
  if dtypes is not None and x.dtype not in dtypes:
    names = ", ".join(str(jnp.dtype(d)) for d in dtypes)
    raise TypeError(f"{name} must be {names}, got {x.dtype}")
  return tuple(x.shape)
