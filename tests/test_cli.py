"""The command line: `run` (fused vs unfused model, kernel counts, agreement), `plot`, `demo`."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cli import main
from models import run as runner


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3.5-tiny"])
def test_run_fused_vs_unfused(tmp_path, capsys, preset):
  out = tmp_path / "run.json"
  assert main(["run", "--model", preset, "--batch", "1", "--prompt-len", "4",
               "--steps", "2", "--json", str(out)]) == 0
  table = capsys.readouterr().out
  assert "kernels per layer saved by the fused path" in table
  r = json.loads(out.read_text())
  fused, unfused = r["fused"], r["unfused"]
  # The fused prepare_attn / prepare_mlp (and MLA's dual norm) drop kernels in every layer.
  assert fused["kernels"]["total"] < unfused["kernels"]["total"]
  assert r["kernels_saved_per_layer"] > 0
  # Same weights, same tokens; only where the norm output is rounded before quantisation
  # differs, so the argmax rarely moves even on a random model.
  assert r["agreement"]["top1"] >= 0.5 and r["agreement"]["kl"] < 0.5
  assert fused["decode_ms"] > 0 and fused["prefill_ms"] > 0


def test_run_tensor_parallel_reports_strategy(tmp_path):
  out = tmp_path / "tp.json"
  assert main(["run", "--tp", "2", "--batch", "1", "--prompt-len", "4", "--steps", "1",
               "--no-compare", "--json", str(out)]) == 0
  r = json.loads(out.read_text())
  assert r["allreduce_strategy"] == "fused" and r["fused"]["kernels"]["collective"] > 0
  assert "unfused" not in r


@pytest.mark.parametrize("preset,tp", [("deepseek-v3-tiny", 1), ("deepseek-v3-tiny", 2),
                                       ("qwen3.5-tiny", 1), ("qwen3.5-tiny", 2)])
def test_step_takes_weights_as_arguments(preset, tp):
  """A jit of the step must not capture the weights as constants: on the H200 the -layers
  presets captured 5-7 GB that way and the compile never finished."""
  built = runner.build(preset, tp=tp)
  forward, params = runner.forward_fn(built.model, tp)
  # a flat list: an nnx.State argument costs the host 3-4x more to flatten at every call
  assert isinstance(params, list) and all(isinstance(p, jax.Array) for p in params)
  tok = jax.random.randint(jax.random.key(0), (1, 1), 0, built.model.cfg.vocab_size)
  traced = jax.jit(forward).trace(params, tok, built.model.init_cache(1, 8), jnp.int32(3))
  captured = sum(np.asarray(c).nbytes for c in traced.jaxpr.consts)
  assert captured < 0.01 * sum(x.nbytes for x in jax.tree.leaves(params))


def test_run_errors(capsys):
  with pytest.raises(ValueError, match="unknown preset"):
    main(["run", "--model", "llama-tiny", "--steps", "1"])
  assert main(["run", "--tp", "64", "--steps", "1"]) == 2
  assert "needs 64 devices" in capsys.readouterr().err


def test_plot(tmp_path):
  """Every benchmark results file in the repository plots."""
  files = sorted((pathlib.Path(__file__).parent.parent / "benchmarks/results").glob("*.json"))
  assert files
  for results in files:
    png = tmp_path / f"{results.stem}.png"
    assert main(["plot", str(results), "--out", str(png)]) == 0, results
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_failed_rows_and_names_cases(tmp_path):
  """A failed check is drawn hatched; the keys that vary between cases label the groups."""
  import json

  import matplotlib.pyplot as plt
  runs = [("a", 1, "unfused", 10.0, True), ("a", 1, "fused", 9.0, True),
          ("b", 8, "unfused", 20.0, True), ("b", 8, "fused", 18.0, False)]
  rows = [dict(case=dict(preset=p, batch=b, tp=1), impl=impl, time_us=t, correct=ok)
          for p, b, impl, t, ok in runs]
  results = tmp_path / "decode.json"
  results.write_text(json.dumps(dict(benchmark="decode", device="X", jax="0", date="d",
                                     rows=rows)))
  assert main(["plot", str(results), "--out", str(tmp_path / "d.png")]) == 0
  ax = plt.gcf().axes[0]
  hatched = [round(b.get_height(), 3) for b in ax.patches if b.get_hatch()]
  assert hatched == [18.0]
  assert [t.get_text() for t in ax.get_xticklabels()] == ["batch=1,preset=a", "batch=8,preset=b"]
  plt.close("all")


def test_demo(capsys):
  assert main(["demo", "--tokens", "4", "--hidden", "576", "--reps", "2"]) == 0
  assert "pallas vs xla: agree" in capsys.readouterr().out
