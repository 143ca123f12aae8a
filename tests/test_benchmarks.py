"""Every benchmark's `--smoke` run on CPU: device time goes only to scripts that run, and whose
correctness checks pass on tiny shapes."""

import enum
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
SMOKE = {
    "allreduce_fusion": [],  # over the 8 simulated CPU devices (conftest's XLA_FLAGS)
    "decode": ["--batches", "1"],
    "fp8_matmul": [],
    "mla_decode": [],
    "moe_gemm": [],
    "prefill": [],  # the tiny presets, prompts of 20 and 37 tokens in chunks of 16
    "rmsnorm_quant": [],
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke(name, tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--out", str(tmp_path),
       *SMOKE[name]], env=dict(os.environ), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  doc = json.loads((tmp_path / f"{name}.json").read_text())
  assert doc["rows"] and all(row["correct"] for row in doc["rows"]), doc["rows"]


def test_decode_smoke_under_tensor_parallelism(tmp_path):
  """decode.py --tp 2 over simulated CPU devices: the serving loop's tokens on the model's mesh
  (a token array off it failed the loop's first update), the timed step's donated cache
  sharded."""
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "decode.py"), "--smoke", "--out", str(tmp_path),
       "--batches", "1", "--tp", "2", "--presets", "deepseek-v3-tiny", "--paths", "fused"],
      env=dict(os.environ), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  doc = json.loads((tmp_path / "decode.json").read_text())
  assert doc["rows"] and all(row["correct"] for row in doc["rows"]), doc["rows"]


def test_idle_gaps():
  """Idle time counts only where no stream is busy, named by the kernels either side."""
  sys.path.insert(0, str(BENCHMARKS))
  from _harness import idle_gaps
  spans = [(100, 130, "c"), (0, 10, "a"), (5, 40, "b"),  # b overlaps a on another stream
           (50, 60, "c"), (135, 150, "a")]
  assert idle_gaps(spans) == {"b -> c": 10, "c -> c": 40, "c -> a": 5}
  # a kernel inside a longer one on another stream leaves no gap of its own
  assert idle_gaps([(0, 100, "long"), (10, 20, "short"), (110, 120, "x")]) == {"long -> x": 10}
  assert idle_gaps([]) == {} and idle_gaps([(3, 9, "a")]) == {}


def test_measure_updates_a_donated_argument_in_place():
  """A donated argument (a decode step's cache) is aliased to the op's output, not copied
  first; each run takes fresh sets; a timing that reruns one set refuses donation."""
  import jax.numpy as jnp
  sys.path.insert(0, str(BENCHMARKS))
  from _harness import measure
  made = []

  def make(n):
    made.append([(jnp.arange(4.0) + i, jnp.full((256,), float(i))) for i in range(n)])
    return made[-1]

  op = lambda a, cache: (a.sum(), cache.at[0].set(a[0]))
  m = measure(op, make, 1, chain=False, hlo=True, donate=(1,))
  assert "input_output_alias" in m["hlo"] and m["chain_s"] is None
  assert len(made) == 2  # the warm-up's set, and a fresh one for the timed run
  assert all(s[0][1].is_deleted() and not s[0][0].is_deleted() for s in made)
  plain = measure(op, make, 1, chain=False, hlo=True)
  assert "input_output_alias" not in plain["hlo"]
  with pytest.raises(ValueError, match="donated"):
    measure(op, make, 1, donate=(1,))


def test_prefill_smoke(tmp_path):
  """--prefill on CPU: the rows and fields fp8_matmul_prefill.json holds; cuBLAS's column is
  skipped with its reason (no torch here, or no CUDA GPU)."""
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "fp8_matmul.py"), "--prefill", "--smoke", "--out",
       str(tmp_path)], env=dict(os.environ), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  why = ("torch is not installed" if importlib.util.find_spec("torch") is None
         else "cuBLAS needs a CUDA GPU")
  assert f"cuBLAS column skipped: {why}" in proc.stdout
  doc = json.loads((tmp_path / "fp8_matmul_prefill.json").read_text())
  assert doc["benchmark"] == "fp8_matmul_prefill" and set(doc["ceilings"]) == {"copy_tbps",
                                                                               "bf16_tflops"}
  rows = doc["rows"]
  assert {r["impl"] for r in rows} == {"xla_bf16", "xla", "default"}
  assert len({json.dumps(r["case"]) for r in rows}) == 2
  for r in rows:
    assert set(r["case"]) == {"M", "N", "K"} and r["correct"], r
    assert {"time_us", "tflops", "vs_xla", "vs_cublas", "err_vs_reference", "calls"} <= set(r)
  assert all(r["pick"] == "xla" for r in rows if r["impl"] == "default")


# A stand-in for _cublas.py with the same files in and out, the product in float64 numpy: the
# operands fp8_matmul.py writes (codes, scales, their orientation) and its checks of what comes
# back, on CPU. It writes no timing anyone reads: the rows it makes stay in this test.
STAND_IN = textwrap.dedent("""
    import json, os, sys
    import ml_dtypes, numpy as np
    d = sys.argv[1]
    res = {"peer": "numpy stand-in", "cases": {}}
    for c in json.load(open(os.path.join(d, "cases.json")))["cases"]:
      part = lambda p: np.load(os.path.join(d, f"{c['id']}_{p}.npy"))
      code = lambda p: part(p).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
      a, w, k = code("a"), code("w"), c["K"]
      a = a * np.repeat(part("a_scale"), 128, axis=1)[:, :k]
      w = w * np.repeat(np.repeat(part("w_scale"), 128, axis=0), 128, axis=1)[:c["N"], :k]
      np.save(os.path.join(d, f"{c['id']}_out.npy"), (a @ w.T)[::c["step"]].astype(np.float32))
      res["cases"][str(c["id"])] = dict(time_us=1.0, median_us=1.0, p10_us=1.0, p90_us=1.0,
                                        calls=c["calls"], kernels_per_call=1.0,
                                        out_dtype="float32", top_kernels={})
    json.dump(res, open(os.path.join(d, "results.json"), "w"))
""")


def test_peer_protocol(tmp_path, monkeypatch):
  """The operands fp8_matmul.py hands the torch side and its checks of the output: partial N and
  K blocks, and M past 256 (sampled rows)."""
  sys.path.insert(0, str(BENCHMARKS))
  import fp8_matmul as bench
  stand_in = tmp_path / "stand_in.py"
  stand_in.write_text(STAND_IN)
  monkeypatch.setattr(bench, "CUBLAS", str(stand_in))
  monkeypatch.setattr(bench, "cublas_unavailable", lambda: None)
  cases = [(600, 200, 300), (3, 256, 384)]
  peer, why = bench.cublas_peer([(*c, 8) for c in cases],
                                lambda i: bench.prefill_problem(*cases[i], i)(1)[0], 300)
  assert why is None and sorted(peer) == [0, 1]
  assert peer[0]["out"].shape == (300, 200)  # every second row of M = 600
  for i, (m, n, k) in enumerate(cases):
    rows = bench.prefill_case(m, n, k, i, ["cublas_blockwise", "xla", "default"], peer[i])
    assert rows["cublas_blockwise"]["err_vs_reference"] < 1e-6, rows
    assert rows["default"]["err_vs_cublas_f32"] < 1e-6 and rows["default"]["pick"] == "xla"
    assert all(r["correct"] for r in rows.values()), rows


def test_scaling_names():
  """The torch side finds a scaling type however a release spells it."""
  sys.path.insert(0, str(BENCHMARKS))
  import _cublas
  for names in (["TensorWise", "BlockWise1x128", "BlockWise128x128"],
                ["Tensorwise", "Blockwise_1x128", "Blockwise_128x128"]):
    kind = enum.Enum("ScalingType", names)
    assert _cublas.member(kind, "BlockWise1x128").name == names[1]
    assert _cublas.member(kind, "BlockWise128x128").name == names[2]
  with pytest.raises(RuntimeError, match="no BlockWise1x128"):
    _cublas.member(enum.Enum("ScalingType", ["RowWise"]), "BlockWise1x128")
  assert _cublas.spread([1.0, 2.0]) == {"median_us": None, "p10_us": None, "p90_us": None}
  assert _cublas.spread([float(i) for i in range(1, 12)])["median_us"] == 6.0


def test_merge_keeps_other_runs(tmp_path):
  """--merge: a run's rows (with the `default` mark of the rows they replace), then the file's
  rows for what it did not measure, each with its own run's commit, date and ceilings."""
  sys.path.insert(0, str(BENCHMARKS))
  import fp8_matmul as bench
  old = {"commit": "a" * 7, "date": "2026-12-01", "ceilings": {"copy_tbps": 4.2}, "rows": [
      {"case": {"M": 256}, "impl": "default", "time_us": 9.0, "default": True},
      {"case": {"M": 4096}, "impl": "default", "time_us": 90.0},
      {"case": {"M": 4096}, "impl": "xla", "time_us": 99.0, "commit": "b" * 7}]}
  (tmp_path / "old.json").write_text(json.dumps(old))
  rows = bench.merged([{"case": {"M": 256}, "impl": "default", "time_us": 8.0}],
                      str(tmp_path / "old.json"))
  assert [(r["case"]["M"], r["time_us"], r.get("commit")) for r in rows] == [
      (256, 8.0, None), (4096, 90.0, "a" * 7), (4096, 99.0, "b" * 7)]
  assert rows[0]["default"] and rows[1]["ceilings"] == {"copy_tbps": 4.2}
  assert bench.merged(rows, None) == rows


def test_sweep_merge_keys_by_config(tmp_path):
  """A sweep's --merge: one row per (case, config); a re-timed config replaces its row."""
  sys.path.insert(0, str(BENCHMARKS))
  import fp8_matmul as bench
  row = lambda config, us: {"case": {"M": 16}, "impl": "mosaic_gpu", "config": config,
                            "time_us": us}
  old = {"commit": "a" * 7, "date": "2026-12-01", "ceilings": {}, "rows": [row("x", 1.0),
                                                                          row("y", 2.0)]}
  (tmp_path / "old.json").write_text(json.dumps(old))
  rows = bench.merged([row("y", 3.0)], str(tmp_path / "old.json"), ("impl", "config"))
  assert [(r["config"], r["time_us"]) for r in rows] == [("y", 3.0), ("x", 1.0)]


def test_sweep_vary_keeps_the_pick_and_one_field():
  """--sweep-vary band: the heuristic's pick and the configs differing from it in band alone."""
  sys.path.insert(0, str(BENCHMARKS))
  import dataclasses
  import fp8_matmul as bench
  m, n, k = 16384, 7168, 16384
  pick = bench.HEURISTICS["mosaic_gpu"](m, n, k)
  got = bench.varying("mosaic_gpu", m, n, k, ["band"])
  assert got[0] == pick and len(got) > 1
  assert all(dataclasses.replace(c, band=pick.band) == pick for c in got)
  assert len(bench.sweep_configs("mosaic_gpu", m, n, k)) > len(got)


def test_moe_gemm_tiles_name_both_kernels():
  """--tiles: Triton entries and mosaic: entries (BAND defaulting to 16); gate_up takes only
  the tilings its paired kernels build (128 columns; one chunk for Mosaic GPU)."""
  sys.path.insert(0, str(BENCHMARKS))
  import moe_gemm as bench
  tiles = ["mosaic:256,2,3", "mosaic:128,1,4,8", "64,64,4,4", "128,128,8,3"]
  assert list(bench.tiled("up", tiles)) == [
      "mosaic_gpu 256/2c/3s/b16", "mosaic_gpu 128/1c/4s/b8", "triton 64x64/4/4",
      "triton 128x128/8/3"]
  assert list(bench.tiled("gate_up", tiles)) == ["mosaic_gpu 128/1c/4s/b8",
                                                 "triton 128x128/8/3"]


def test_expected_ranges_hold_what_the_script_measures():
  """`jfusedq run`'s expected numerics ranges (models.run.EXPECTED) contain what
  benchmarks/expected_ranges.py measures, on the first seeds it measured them over."""
  sys.path.insert(0, str(BENCHMARKS))
  import expected_ranges
  from models.run import EXPECTED
  for pair, runs in expected_ranges.seed_figures("llama-tiny", 4).items():
    kl_lo, kl_hi, top_lo, top_hi = EXPECTED["llama-tiny"][pair]
    for r in runs:
      assert kl_lo <= r["kl"] <= kl_hi and top_lo <= r["top1"] <= top_hi, (pair, r)
