"""The README's Python examples run as written."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 3
  namespace = {}
  exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102 (our own documentation)
  assert namespace["y"].shape == (namespace["tokens"], namespace["hidden"])
  # The ragged_dot example: row r of the expert-sorted entries times its expert's w_gate.
  flat_ids = np.asarray(namespace["ids"]).reshape(-1)
  x, w_gate = np.asarray(namespace["x"], np.float64), np.asarray(namespace["w_gate"], np.float64)
  entries = np.argsort(flat_ids, kind="stable")
  want = np.stack([x[e // namespace["top_k"]] @ w_gate[flat_ids[e]] for e in entries])
  np.testing.assert_allclose(np.asarray(namespace["out"], np.float64), want, atol=5e-2)
  assert int(namespace["stats"].dropped_tokens.sum()) == 0
