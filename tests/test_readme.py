"""The README's Python snippets run as written, in order, in one namespace (the second
continues the first)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> list[str]:
  return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)


def test_readme_snippets_run():
  code = snippets()
  assert len(code) >= 2
  namespace: dict = {}
  for i, text in enumerate(code):
    exec(compile(text, f"README.md python snippet {i + 1}", "exec"), namespace)
  # What the comments promise: the fused layer input, the MoE products, the TP step.
  assert namespace["h"].shape == (16, 7168) and namespace["y"].shape == (32, 256)
  assert namespace["quant"].q.shape == (16, 7168)
