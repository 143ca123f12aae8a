"""The library never imports its users: no module under jfusedq/ imports `models`."""

import ast
import pathlib

LIB = pathlib.Path(__file__).resolve().parent.parent / "jfusedq"


def imported(tree: ast.AST):
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.module
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
          in ("import_module", "__import__") and node.args
          and isinstance(node.args[0], ast.Constant)):
      yield str(node.args[0].value)


def test_library_does_not_import_models():
  files = sorted(LIB.rglob("*.py"))
  assert files
  bad = [f"{f.relative_to(LIB.parent)}: {name}" for f in files
         for name in imported(ast.parse(f.read_text(), str(f)))
         if name == "models" or name.startswith("models.")]
  assert not bad, bad
