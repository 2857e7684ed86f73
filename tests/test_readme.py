"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 3
  namespace = {}
  exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102 (our own documentation)
  assert namespace["y"].shape == (namespace["tokens"], namespace["hidden"])
  assert int(namespace["stats"].dropped_tokens.sum()) == 0
