"""`MoEStats`: the token accounting `moe_ffn(..., return_stats=True)` returns beside y, for every backend."""

from __future__ import annotations

from typing import NamedTuple

import jax


class MoEStats(NamedTuple):
  """Per-rank token accounting of one `moe_ffn` call.

  dropped_tokens: int32 scalar, (token, slot) entries of this rank's tokens that no expert processed (over the
    receive capacity of their expert's rank, or an id outside the experts); they contribute nothing to y.
  received_tokens: int32 scalar, rows this rank's experts processed.
  """

  dropped_tokens: jax.Array
  received_tokens: jax.Array
