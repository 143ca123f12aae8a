"""benchmarks/report.py: the performance pages match benchmarks/results/, and the tables say
what the results files say (failed checks marked, never a speed-up)."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402  (benchmarks/ is scripts, not a package)

PAGE = f"# page\n\nkept above\n\n{report.BEGIN}\nSTALE TABLE\n{report.END}\n\nkept below\n"


def test_pages_are_current():
  """CI's guard: benchmarks/README.md and README.md hold what results/ gives."""
  assert report.main(["--check"]) == 0


def test_one_file_per_benchmark():
  """results/ holds one JSON per benchmark script, named after it."""
  names = sorted(p.stem for p in (ROOT / "benchmarks/results").iterdir())
  assert names and all(p.suffix == ".json" for p in (ROOT / "benchmarks/results").iterdir())
  assert all((ROOT / "benchmarks" / f"{name}.py").exists() for name in names)
  for name in names:
    doc = json.loads((ROOT / "benchmarks/results" / f"{name}.json").read_text())
    assert doc["benchmark"] == name
    assert {"device", "devices", "jax", "commit", "date", "ceilings", "rows"} <= set(doc)


def _doc(rows, **head):
  return {"benchmark": "fp8_matmul", "device": "NVIDIA H200", "devices": 1, "jax": "0.11.2",
          "commit": "a" * 40, "date": "2026-12-01", "ceilings": {"copy_tbps": 4.3},
          "rows": rows, **head}


def _row(impl, time_us, correct=True, default=False, m=1, **extra):
  return {"case": {"M": m, "N": 2112, "K": 7168}, "impl": impl, "time_us": time_us,
          "tbps": 1.0, "tflops": 1.0, "roofline_frac": 0.5, "vs_xla": 2.0, "correct": correct,
          "default": default, **extra}


def _write(tmp_path, docs):
  results = tmp_path / "results"
  results.mkdir()
  for name, doc in docs.items():
    (results / f"{name}.json").write_text(json.dumps(doc))
  for page in ("page.md", "readme.md"):
    (tmp_path / page).write_text(PAGE)
  return ["--results", str(results), "--page", str(tmp_path / "page.md"),
          "--readme", str(tmp_path / "readme.md")]


def test_regenerate_then_check(tmp_path, capsys):
  rows = [_row("xla_bf16", 2.0), _row("triton", 1.0, default=True), _row("triton", 3.0, m=16)]
  args = _write(tmp_path, {"fp8_matmul": _doc(rows)})
  assert report.main(args + ["--check"]) == 1
  assert "stale" in capsys.readouterr().err
  assert report.main(args) == 0
  assert report.main(args + ["--check"]) == 0
  page = (tmp_path / "page.md").read_text()
  assert page.startswith("# page\n\nkept above\n\n") and page.endswith("\n\nkept below\n")
  assert "STALE TABLE" not in page
  assert "| 1 | 2.00 | **1.00** | triton |" in page and "N = 2112, K = 7168" in page
  assert "Commit `aaaaaaa`, 2026-12-01" in page


def test_failed_check_is_marked_and_gives_no_ratio(tmp_path):
  rows = [_row("xla_bf16", 2.0), _row("triton", 1.0, correct=False, default=True),
          _row("triton", 3.0, m=16)]
  args = _write(tmp_path, {"fp8_matmul": _doc(rows)})
  report.main(args)
  line = next(l for l in (tmp_path / "page.md").read_text().splitlines() if l.startswith("| 1 "))
  assert f"**1.00 {report.FAILED}**" in line
  assert "2.00x" not in line and line.rstrip(" |").endswith(report.FAILED)


def test_rows_of_other_runs_keep_their_commit(tmp_path):
  rows = [_row("triton", 1.0, default=True),
          {**_row("triton", 3.0, default=True), "case": {"M": 4096, "N": 2112, "K": 7168},
           "commit": "b" * 7, "date": "2026-11-30", "ceilings": {"copy_tbps": 4.2}}]
  args = _write(tmp_path, {"fp8_matmul": _doc(rows)})
  report.main(args)
  page = (tmp_path / "page.md").read_text()
  assert "Commit `aaaaaaa`, 2026-12-01" in page and "Commit `bbbbbbb`, 2026-11-30" in page
  assert "copy 4.2 TB/s; M = 4096" in " ".join(page.split())


def test_decode_speed_up_is_unfused_over_fused(tmp_path):
  case = {"preset": "p", "batch": 1}
  rows = [{"case": case, "impl": "unfused", "time_us": 110.0, "steady_us": 120.0,
           "kernels": {"total": 10}, "correct": True},
          {"case": case, "impl": "fused", "time_us": 100.0, "steady_us": 100.0,
           "kernels": {"total": 8}, "correct": True}]
  args = _write(tmp_path, {"decode": _doc(rows, benchmark="decode")})
  report.main(args)
  page = (tmp_path / "page.md").read_text()
  assert "| 110.0 / 120.0 | **100.0 / 100.0** | fused | 1.100x | 1.200x | 10 -> 8 | - |" in page


def test_missing_markers(tmp_path):
  args = _write(tmp_path, {})
  (tmp_path / "page.md").write_text("# no markers\n")
  with pytest.raises(SystemExit, match="markers"):
    report.main(args)
