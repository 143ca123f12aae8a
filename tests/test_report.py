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


# Results of a script's mode, named after the script and the mode.
MODES = {"decode_context": "decode",  # --context 256 32768 --paths fused --tag context
         "decode_moe_fused": "decode",  # --paths fused --tag moe_fused
         "fp8_matmul_prefill": "fp8_matmul",  # fp8_matmul.py --prefill
         "fp8_matmul_sweep_mosaic_gpu": "fp8_matmul",  # --sweep --sweep-impl mosaic_gpu
         # --sweep --sweep-impl mosaic_gpu --sweep-vary pingpong --tag pingpong
         "fp8_matmul_sweep_mosaic_gpu_pingpong": "fp8_matmul",
         "mla_decode_flat": "mla_decode",  # --sweep --heads 128 --tag flat
         "mla_decode_sweep": "mla_decode",  # --sweep --tag sweep
         "mla_decode_vary": "mla_decode",  # --vary ... --tag vary
         "moe_gemm_mosaic": "moe_gemm",  # --impls triton mosaic_gpu --tag mosaic
         "moe_gemm_qwen_h100": "moe_gemm",  # --models qwen3.5 --tag qwen_h100
         "moe_gemm_swiglu_h100": "moe_gemm",  # --projs gate_up up --tiles ... --tag swiglu_h100
         "moe_gemm_switch": "moe_gemm",  # --tokens 1 16 --impls default gathered --tag switch
         "prefill_h100": "prefill",  # --tag h100
         "prefill_moe": "prefill"}  # --presets deepseek-v3-moe --paths fused --tag moe


def test_one_file_per_benchmark():
  """results/ holds one JSON per benchmark script (or mode of one), named after it."""
  names = sorted(p.stem for p in (ROOT / "benchmarks/results").iterdir())
  assert names and all(p.suffix == ".json" for p in (ROOT / "benchmarks/results").iterdir())
  assert all((ROOT / "benchmarks" / f"{MODES.get(name, name)}.py").exists() for name in names)
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


def test_decode_speed_ups_are_unfused_and_bf16_over_fused(tmp_path):
  case = {"preset": "p", "batch": 1}
  rows = [{"case": case, "impl": "unfused", "time_us": 110.0, "steady_us": 120.0,
           "kernels": {"total": 10}, "correct": True},
          {"case": case, "impl": "fused", "time_us": 100.0, "steady_us": 100.0,
           "kernels": {"total": 8}, "correct": True},
          {"case": case, "impl": "bf16", "time_us": 250.0, "steady_us": 300.0,
           "kernels": {"total": 7}, "correct": True}]
  args = _write(tmp_path, {"decode": _doc(rows, benchmark="decode")})
  report.main(args)
  page = (tmp_path / "page.md").read_text()
  assert ("| 110.0 / 120.0 | **100.0 / 100.0** | 250.0 / 300.0 | fused | 1.100x | 1.200x | "
          "3.000x | 10 -> 8 | - |") in page


def test_prefill_speed_ups(tmp_path):
  """The prefill table: the default's speed-up over cuBLAS and XLA bf16 per cell, its pick, and
  no ratio against a cuBLAS row that failed its check."""
  def row(impl, time_us, m, **extra):
    return {"case": {"M": m, "N": 2112, "K": 7168}, "impl": impl, "time_us": time_us,
            "tflops": 1.0, "correct": True, **extra}
  rows = [row("cublas_blockwise", 12.0, 256, p10_us=11.5, p90_us=12.5), row("xla_bf16", 20.0, 256),
          row("mosaic_gpu", 10.0, 256), row("default", 10.0, 256, pick="mosaic_gpu"),
          row("cublas_blockwise", 30.0, 4096, correct=False), row("xla_bf16", 20.0, 4096),
          row("mosaic_gpu", 25.0, 4096), row("default", 25.0, 4096, pick="mosaic_gpu")]
  args = _write(tmp_path, {"fp8_matmul_prefill": _doc(rows, benchmark="fp8_matmul_prefill")})
  report.main(args)
  page = (tmp_path / "page.md").read_text()
  assert ("| 256 | 12.00 | 20.00 | 10.00 | **10.00** | mosaic_gpu | 1.0 | 1.200x | 2.000x "
          "| 11.50-12.50 |") in page
  assert f"| 4096 | 30.00 {report.FAILED} |" in page and f"| {report.FAILED} | 0.800x | - |" in page
  assert "| M | (2112, 7168) |" in page and "| 256 | 1.200x / 2.000x |" in page
  assert f"| 4096 | {report.FAILED} / 0.800x |" in page
  readme = (tmp_path / "readme.md").read_text()
  assert "fp8_matmul_prefill" not in readme  # its headline case (M = 4096, (7168, 16384)) absent


def test_missing_markers(tmp_path):
  args = _write(tmp_path, {})
  (tmp_path / "page.md").write_text("# no markers\n")
  with pytest.raises(SystemExit, match="markers"):
    report.main(args)


def test_sweep_rows_by_config(tmp_path):
  """A sweep's table: a line per config, the heuristic's pick in bold, each config's speed
  against the pick; a failed check marked and without a ratio."""
  row = lambda config, us, pick=False, ok=True: {
      "case": {"M": 16, "N": 2112, "K": 7168}, "impl": "mosaic_gpu", "time_us": us,
      "tflops": 1.0, "correct": ok, "config": f"Config({config})", "heuristic": pick}
  doc = dict(_doc([row("band=16", 2.0, pick=True), row("band=8", 1.0), row("band=4", 4.0,
                                                                           ok=False)]),
             benchmark="fp8_matmul_sweep_mosaic_gpu")
  args = _write(tmp_path, {"fp8_matmul_sweep_mosaic_gpu": doc})
  assert report.main(args) == 0
  page = (tmp_path / "page.md").read_text()
  assert "| **band=16** | **2.00** | 1.0 | 1.000x |" in page
  assert "| band=8 | 1.00 | 1.0 | 2.000x |" in page
  assert f"| band=4 | 4.00 {report.FAILED} | 1.0 | {report.FAILED} |" in page


def test_accuracy_grid_gives_every_path_its_figures(tmp_path):
  """The accuracy run's second table: a line per path with its NLL, its paired differences
  from bf16 and from the unfused path (each +- its standard error), KL and top-1; a failed
  gate marked."""
  case = {"model": "m", "text": "t", "tokens": 2048, "windows": 2, "window": 1024}
  def row(impl, nll, fmt=None, correct=True, **extra):
    return {"case": case, "impl": impl, "format": fmt, "nll": nll, "delta_vs_bf16": nll - 2.0,
            "delta_se": 0.01, "kl_vs_bf16": 0.02, "top1_vs_bf16": 0.9, "vs_unfused": None,
            "vs_unfused_se": None, "vs_xla": None, "vs_xla_se": None, "correct": correct,
            **extra}
  rows = [row("bf16", 2.0), row("unfused", 2.05, "e4m3fn"),
          row("fused", 2.5, "e4m3fn", correct=False, vs_unfused=0.45, vs_unfused_se=0.002)]
  args = _write(tmp_path, {"accuracy": _doc(rows, benchmark="accuracy")})
  report.main(args)
  page = (tmp_path / "page.md").read_text()
  assert "Per path, 2048 tokens (2 x 1024) of t;" in page
  assert "| bf16 | 2.0000 | - | 0.0200 | 0.9000 | - |" in page
  assert "| unfused | 2.0500 | +0.0500 +- 0.0100 | 0.0200 | 0.9000 | - |" in page
  assert (f"| fused | 2.5000 {report.FAILED} | +0.5000 +- 0.0100 | 0.0200 | 0.9000 | "
          "+0.4500 +- 0.0020 |") in page
