"""The command line: `run` (bf16, FP8 unfused and FP8 fused on one set of weights: step times,
kernel counts, numerics), its bad-input errors, `plot`, `demo`."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from models import cost
from models import run as runner
from models.cli import main
from models.presets import PRESETS

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3.5-tiny", "llama-tiny"])
def test_run_three_paths(tmp_path, capsys, preset):
  assert main(["run", "--model", preset, "--batch", "1", "--prompt-len", "4", "--steps", "2",
               "--repeats", "2", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr()
  assert "NOT kernel speeds" in out.out and "the fused path launches" in out.out
  # Every ratio says which way it goes, and on CPU why FP8 is slower there.
  ratios = [line for line in out.out.splitlines() if line.startswith("step time ")]
  assert len(ratios) == 3 and all(
      any(w in line for w in (" slower than ", " faster than ", " as fast as ")) for line in ratios)
  assert "why, on CPU: no FP8 units" in out.out
  for phase in ("built", "compiled bf16", "compiled fused", "rounds of 2 decode steps"):
    assert phase in out.err
  r = json.loads((tmp_path / f"run_{preset}.json").read_text())
  # What the run was: enough to repeat it and to place it in the history.
  assert r["seed"] == 0 and r["jax"] == jax.__version__ and r["date"]
  assert r["commit"] == runner.checkout_commit() and r["commit"]
  paths = r["paths"]
  assert list(paths) == ["bf16", "unfused", "fused"]
  for x in paths.values():
    k = x["kernels"]
    assert k["total"] == k["fusion"] + k["custom-call"] + k["collective"] + k["other"]
    assert x["step_ms_p10"] <= x["step_ms"] <= x["step_ms_p90"] and x["enqueue_ms"] > 0
    assert x["prefill_tokens_per_s"] == pytest.approx(1 * 4 / (x["prefill_ms"] * 1e-3))
    # No GPU profile on CPU, no peaks measured: no kernel times, no roofline fractions.
    assert x["device_ms"] is None and x["prefill_device_ms"] is None
    assert x["roofline_frac"] is None and x["prefill_roofline_frac"] is None
  assert r["peaks"] is None and "no roofline fractions on cpu" in out.out
  # The fused prepare_attn / prepare_mlp (and MLA's dual norm) drop kernels in every layer.
  saved = paths["unfused"]["kernels"]["total"] - paths["fused"]["kernels"]["total"]
  assert saved > 0 and r["kernels_saved_per_step"] == saved
  assert r["kernels_saved_per_layer"] == saved / r["layers"]
  # The tables' columns are the JSON's keys.
  heads = [line.split() for line in out.out.splitlines() if line.split()[:1] == ["path"]]
  assert len(heads) == 2 and {k for head in heads for k in head
                              if k not in ("path", "step_ms_p10-p90")} <= (
      set(paths["fused"]) | set(paths["fused"]["kernels"]))
  assert set(r["ratios"]) == {"fused/bf16", "unfused/bf16", "fused/unfused"}
  # One set of weights: FP8 is a small perturbation of bf16, not another random draw.
  for pair, a in r["numerics"].items():
    assert a["kl"] < 0.2, pair
    assert a["expected"] is None  # measured at RANGE_BATCH x RANGE_PROMPT, not at 1 x 4
  assert "ranges measured at batch 2 x prompt 16 only" in out.out
  # What FP8 costs comes from the trained model, beside the random weights' agreement, labelled
  # as the stored result it is.
  cost = runner.fp8_cost("e4m3fn")
  assert r["fp8_cost"]["bf16_nll"] == cost["bf16_nll"]
  assert "what FP8 costs on a trained model (a stored result, not this run's model" in out.out
  assert f"model {cost['case']['model']}; " in out.out  # the source weights' quantisation too


def test_run_prints_the_ranges_at_the_size_they_were_measured_at(tmp_path, capsys):
  assert (runner.RANGE_BATCH, runner.RANGE_PROMPT) == (2, 16)  # the CLI's defaults
  assert main(["run", "--model", "llama-tiny", "--paths", "bf16", "unfused", "--steps", "1",
               "--repeats", "1", "--out", str(tmp_path)]) == 0
  r = json.loads((tmp_path / "run_llama-tiny.json").read_text())
  lo, hi, top_lo, top_hi = runner.EXPECTED["llama-tiny"][("bf16", "unfused")]
  assert r["numerics"]["bf16 -> unfused"]["expected"] == dict(
      kl_low=lo, kl_high=hi, top1_low=top_lo, top1_high=top_hi)
  assert "expected " in capsys.readouterr().out


def test_ratios_say_their_direction():
  assert runner.direction("fused/bf16", 3.009) == "fused 3.01x slower than bf16"
  assert runner.direction("fused/unfused", 0.8) == "fused 1.25x faster than unfused"
  assert runner.direction("fused/unfused", 1.0004) == "fused as fast as unfused"


def test_table_of_a_gpu_run():
  """A GPU run's table (the CPU suite cannot make one): kernel times, who sets the pace, no
  CPU caveats."""
  kernels = dict(total=180, fusion=150, **{"custom-call": 30}, collective=0, other=0)
  path = dict(compile_s=1.0, prefill_ms=2.0, prefill_device_ms=1.5, prefill_tokens_per_s=8000.0,
              prefill_roofline_frac=0.123, step_ms=1.1, step_ms_p10=1.0, step_ms_p90=1.2,
              enqueue_ms=0.5, device_ms=1.0, tokens_per_s=900.0, roofline_frac=0.734,
              kernels=kernels)
  r = dict(model="deepseek-v3-layers", platform="gpu", device="NVIDIA H200", tp=1, batch=1,
           prompt_len=16, layers=4, repeats=2, steps=8, steps_per_call=8,
           peaks=dict(copy_tbps=4.28, bf16_tflops=717.8, fp8_tflops=1435.6),
           paths={"unfused": dict(path, step_ms=1.2, kernels=dict(kernels, total=196)),
                  "fused": path},
           ratios={"fused/unfused": dict(ratio=1.1 / 1.2, within_noise=False)},
           kernels_saved_per_step=16, kernels_saved_per_layer=4.0, numerics={})
  text = runner.table(r)
  assert ("roofline peaks, measured on this device: copy 4.28 TB/s, XLA bf16 dot 718 TFLOP/s, "
          "FP8 taken as 1436") in text
  rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["fused"]]
  assert rows[0][-2:] == ["8000.0", "0.123"] and "0.734" in rows[1] and "-" not in rows[1]
  assert "fused: a step's wall time is 1.10x its kernel time; enqueueing it takes the host 0.50x" \
      " the kernel time (the GPU sets the pace)" in text
  assert "step time fused/unfused: 0.917x, fused 1.09x faster than unfused" in text
  assert "the fused path launches 16 fewer, 4.00 a layer on average over its 4 layers" in text
  assert "CPU" not in text


def test_rooflines_hold_kernel_times_to_the_floors():
  """A path's fractions (the CPU suite measures no peaks): `models.cost`'s floors at the run's
  peaks, the prefill's logits at every position, over its kernel times; none without peaks or
  without that kernel time."""
  model = runner.build("deepseek-v3-tiny").path("fused")
  cache = jax.eval_shape(lambda: runner.new_cache(model, 2, 20))
  peaks = dict(copy_tbps=4.0, bf16_tflops=800.0, fp8_tflops=1600.0)
  x = dict(prefill_device_ms=0.5, device_ms=0.25)
  got = runner.rooflines(model, x, peaks, 2, 16, cache)
  proj, attn = cost.prefill_flops(model, 2, 16, logits="all")
  assert got["prefill_roofline_frac"] == pytest.approx((proj / 1600e12 + attn / 800e12) / 5e-4)
  read = cost.weight_bytes(model, 2) + cost.cache_bytes(cache)
  assert got["roofline_frac"] == pytest.approx(read / 4e12 / 2.5e-4)
  assert runner.rooflines(model, x, None, 2, 16, cache) == dict(prefill_roofline_frac=None,
                                                                roofline_frac=None)
  assert runner.rooflines(model, dict(x, device_ms=None), peaks, 2, 16,
                          cache)["roofline_frac"] is None


def test_out_names_a_file_or_a_folder(tmp_path):
  from models.cli import _output
  assert _output(str(tmp_path / "a" / "r.json"), "run_x.json", ".json") == str(
      tmp_path / "a" / "r.json")
  assert (tmp_path / "a").is_dir()
  assert _output(str(tmp_path / "b"), "run_x.json", ".json") == str(tmp_path / "b" / "run_x.json")
  (tmp_path / "old.json").mkdir()  # a folder named like a file stays a folder
  assert _output(str(tmp_path / "old.json"), "run_x.json", ".json") == str(
      tmp_path / "old.json" / "run_x.json")


def test_fp8_cost_reads_the_accuracy_results(tmp_path):
  """The trained-model reference: the main case's XLA rows in the format asked, amax scales."""
  cost = runner.fp8_cost("e4m3fn")
  assert cost["bf16_nll"] > 2 and set(cost) >= {"unfused", "fused", "case", "commit"}
  assert 0 < cost["fused"]["nll_delta"] < 0.08 and 0 < cost["fused"]["se"] < 0.05
  assert cost["case"]["model"].startswith("SmolLM2") and cost["date"] and cost["device"]
  assert runner.fp8_cost("e4m3fn", str(tmp_path / "absent.json")) is None
  # Each format from the largest case that measured it, with that row's own run.
  case = lambda tokens: {"model": "m", "text": "t", "tokens": tokens}
  row = lambda tokens, fmt, fused=None, delta=0.0, **kw: {
      "case": case(tokens), "implementation": "xla", "ue8m0": False if fmt else None,
      "format": fmt, "fused": fused, "nll": 2.0 + delta, "delta_vs_bf16": delta,
      "delta_se": 0.001, **kw}
  path = tmp_path / "accuracy.json"
  path.write_text(json.dumps({"commit": "new", "rows": [
      row(4096, None), row(4096, "e4m3fn", True, 0.02),
      row(1024, None, commit="old"), row(1024, "e4m3fnuz", False, 0.03, commit="old"),
      row(1024, "e4m3fn", True, 0.05, commit="old")]}))
  assert runner.fp8_cost("e4m3fn", str(path))["fused"] == dict(nll_delta=0.02, se=0.001)
  fnuz = runner.fp8_cost("e4m3fnuz", str(path))
  assert fnuz["unfused"] == dict(nll_delta=0.03, se=0.001) and fnuz["case"] == case(1024)
  assert fnuz["commit"] == "old" and "fused" not in fnuz
  assert runner.fp8_cost("e4m3fnuz", str(tmp_path / "absent.json")) is None


def test_paths_share_one_set_of_weights():
  """bf16 masters; FP8 = those quantised; fused and unfused hold the very same arrays."""
  built = runner.build("qwen3.5-tiny", fp8=False)
  master = built.model
  unfused, fused = built.make(False, fp8=True), built.make(True, fp8=True)
  again = built.make(False, fp8=False)
  assert built.master is master and all(
      a is b for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(master))))
  m = dict(nnx.to_flat_state(nnx.state(master)))
  u = dict(nnx.to_flat_state(nnx.state(unfused)))
  f = dict(nnx.to_flat_state(nnx.state(fused)))
  assert set(u) == set(f) and set(m) <= set(u)
  quantised = 0
  for path, var in u.items():
    assert var.get_value() is f[path].get_value(), path
    if path[-1] == "weight_scale_inv":
      continue
    w, mw = var.get_value(), m[path].get_value()
    if jnp.dtype(w.dtype).itemsize == 1:
      s = u[path[:-1] + ("weight_scale_inv",)].get_value()
      deq = (jax.vmap(dequantize_weight) if w.ndim == 3 else dequantize_weight)(w, s)
      ref = np.asarray(mw, np.float32)
      err = np.linalg.norm(np.asarray(deq, np.float32) - ref) / np.linalg.norm(ref)
      assert err < 0.05, (path, err)  # e4m3's 3 mantissa bits: ~2-3% relative RMS
      quantised += 1
    else:
      assert w is mw, path
  assert quantised > 10
  # Another backend over the same arrays (the decode benchmark's XLA reference): no copy.
  xla = built.make(True, fp8=True, implementation="xla")
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(xla)),
                                    jax.tree.leaves(nnx.state(fused))))
  assert xla.opts.implementation == "xla" and fused.opts.implementation is None


def test_fp8_only_build_holds_no_masters():
  """master=False: FP8 weights drawn directly (the -moe presets on an 80 GB GPU); fused and
  unfused share them; a bf16 path is refused, not silently built from other weights."""
  built = runner.build("deepseek-v3-tiny", master=False)
  assert built.master is None
  fused, unfused = built.path("fused"), built.path("unfused")
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(fused)),
                                    jax.tree.leaves(nnx.state(unfused))))
  codes = [v for v in jax.tree.leaves(nnx.state(fused)) if jnp.dtype(v.dtype).itemsize == 1]
  assert len(codes) > 10
  with pytest.raises(ValueError, match="no bf16 path"):
    built.path("bf16")
  with pytest.raises(ValueError, match="FP8 weights only"):
    runner.build("deepseek-v3-tiny", fp8=False, master=False)


def test_decode_call_donates_what_it_updates_and_picks_the_tokens_on_device():
  built = runner.build("qwen3.5-tiny")
  forward, params = runner.forward_fn(built.model, 1)
  prefill, decode = runner.step_fns(forward)
  tokens = jnp.zeros((1, 4), jnp.int32)
  _, tok, cache = prefill(params, tokens, runner.new_cache(built.model, 1, 8))
  toks = runner.first_toks(tok, 4)
  old, pos = jax.tree.leaves(cache), jnp.int32(4)
  toks2, cache, pos2 = decode(params, toks, cache, pos)
  # updated in place: the cache, the tokens and the position; the weights are kept
  assert all(a.is_deleted() for a in old) and toks.is_deleted() and pos.is_deleted()
  assert not any(p.is_deleted() for p in params)
  assert isinstance(toks2, jax.Array) and toks2.shape == (1, 4) and int(pos2) == 8


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3.5-tiny"])
def test_decode_call_of_k_steps_is_k_calls_of_one(preset):
  """Tokens and cache, bit for bit: the loop changes how steps are launched, not what they do."""
  built = runner.build(preset)
  forward, params = runner.forward_fn(built.model, 1)
  prefill, decode = runner.step_fns(forward)
  tokens = runner.prompt(built.model.cfg.vocab_size, 2, 5, seed=3)
  outs = []
  for k in (4, 1):
    _, tok, cache = prefill(params, tokens, runner.new_cache(built.model, 2, 9))
    toks, pos, seen = runner.first_toks(tok, k), jnp.int32(5), []
    for _ in range(4 // k):
      toks, cache, pos = decode(params, toks, cache, pos)
      seen.append(np.asarray(toks))
    outs.append((np.concatenate(seen, 1), [np.asarray(c) for c in jax.tree.leaves(cache)]))
  (toks4, cache4), (toks1, cache1) = outs
  np.testing.assert_array_equal(toks4, toks1)
  assert len(set(toks1.ravel())) > 1  # a real sequence, not one token repeated
  for a, b in zip(cache4, cache1):
    np.testing.assert_array_equal(a, b)


def test_chunk_for_divides_the_round():
  assert [runner.chunk_for(s) for s in (1, 2, 7, 12, 32, 13)] == [1, 2, 7, 6, 8, 1]


def test_run_tensor_parallel_reports_strategy(tmp_path):
  """Also: an --out ending in .json is the file written, in a folder made for it."""
  out = tmp_path / "new" / "tp2.json"
  assert main(["run", "--tp", "2", "--batch", "1", "--prompt-len", "4", "--steps", "1",
               "--repeats", "1", "--paths", "fused", "--out", str(out)]) == 0
  r = json.loads(out.read_text())
  assert r["allreduce_strategy"] == "fused" and r["paths"]["fused"]["kernels"]["collective"] > 0
  assert list(r["paths"]) == ["fused"] and r["numerics"] == {}
  assert r["peaks"] is None and r["paths"]["fused"]["roofline_frac"] is None


@pytest.mark.parametrize("preset,tp", [("deepseek-v3-tiny", 1), ("deepseek-v3-tiny", 2),
                                       ("qwen3.5-tiny", 1), ("qwen3.5-tiny", 2),
                                       ("llama-tiny", 2)])
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


def _checkpoint(tmp_path, name, config):
  d = tmp_path / name
  d.mkdir()
  if config is not None:
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
  return str(d)


BAD_RUN = {
    "unknown preset": (["--model", "llama-huge"], "unknown preset 'llama-huge'; choose from "
                       + ", ".join(PRESETS)),
    "tp beyond devices": (["--tp", "64"], "--tp 64 needs 64 devices; 8 available"),
    "tp not dividing devices": (["--tp", "3"], "--tp 3 does not divide the 8 devices"),
    "tp not dividing heads": (["--model", "qwen3.5-tiny", "--tp", "8"],
                              "qwen3.5-tiny: --tp 8: tensor parallelism over 8 devices needs "
                              "linear_num_key_heads=4 divisible by 8; --tp values that work "
                              "here: 1, 2"),
    # Heads that split, FP8 weights that do not: 256 expert rows are 64 a device, half a block.
    "tp splitting FP8 blocks": (["--tp", "4"],
                                "deepseek-v3-tiny: --tp 4: FP8 parameter layers.1.mlp.experts."),
    "tp splitting llama's blocks": (["--model", "llama-tiny", "--tp", "4"],
                                    "would straddle two devices; --tp values that work here: "
                                    "1, 2"),
    "tp zero": (["--tp", "0"], "argument --tp: must be a positive integer, got 0"),
    "batch zero": (["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    "steps negative": (["--steps", "-3"], "argument --steps: must be a positive integer"),
    "prompt zero": (["--prompt-len", "0"], "argument --prompt-len: must be a positive integer"),
    "repeats text": (["--repeats", "x"], "argument --repeats: 'x' is not an integer"),
    "no checkpoint": (["--checkpoint", "/nonexistent/ckpt"],
                      "checkpoint /nonexistent/ckpt: no such folder"),
    "checkpoint is a file": (["--checkpoint", __file__], "not a folder"),
    "no config.json": (["--checkpoint", "{empty}"], "no config.json in the folder"),
    "bad config.json": (["--checkpoint", "{garbled}"], "config.json: unreadable"),
    "unsupported model_type": (["--checkpoint", "{gpt2}"],
                               "model_type 'gpt2' is not supported (supported: "),
    "no tensors": (["--checkpoint", "{empty_weights}"],
                   "CheckpointError: no model.safetensors.index.json"),
    "out is a file": (["--out", __file__], "is a file, not a folder"),
    "out under a file": (["--out", __file__ + "/runs"], "cannot create the folder"),
}


@pytest.mark.parametrize("case", list(BAD_RUN))
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
  folders = {"empty": _checkpoint(tmp_path, "empty", None),
             "garbled": _checkpoint(tmp_path, "garbled", "{not json"),
             "gpt2": _checkpoint(tmp_path, "gpt2", {"model_type": "gpt2"}),
             "empty_weights": _checkpoint(tmp_path, "w", PRESETS["deepseek-v3-tiny"])}
  argv, want = BAD_RUN[case]
  argv = [a.format(**folders) for a in argv]
  assert main(["run", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and want in err[0], err


def test_tp_is_checked_before_building(monkeypatch, capsys):
  """The split is checked on the model's shapes alone, before a weight is made."""
  monkeypatch.setattr(runner, "build", lambda *a, **kw: pytest.fail("the model was built"))
  assert main(["run", "--tp", "4", "--steps", "1"]) == 2
  assert "--tp values that work here: 1, 2" in capsys.readouterr().err


def test_tp_fp8_blocks_matter_only_with_an_fp8_path():
  """bf16 alone splits wherever the heads do; the FP8 paths also need whole weight blocks."""
  from models.cli import UsageError, _check_model
  _check_model(PRESETS["deepseek-v3-tiny"], 4, "deepseek-v3-tiny", fp8=False)
  with pytest.raises(UsageError, match="not a multiple of the 128 x 128 weight block"):
    _check_model(PRESETS["deepseek-v3-tiny"], 4, "deepseek-v3-tiny", fp8=True)


def test_tp_sizes_are_those_that_split():
  from models import registry
  from models.common import sharding
  model = nnx.eval_shape(lambda: registry.build(PRESETS["deepseek-v3-tiny"], tp_axis="tp"))
  assert sharding.tp_sizes(model) == [1, 2]
  state = nnx.state(model)
  sharding.split_specs(model, state, 2)
  with pytest.raises(ValueError, match="straddle"):
    sharding.split_specs(model, state, 4)


def test_bad_input_is_reported_before_jax_is_imported():
  """The argument and preset checks run before anything heavy is imported (well under a
  second); only the device count and the model checks need JAX."""
  code = ("import sys; from models.cli import main; rc = main(sys.argv[1:]); "
          "assert 'jax' not in sys.modules; sys.exit(rc)")
  for argv in (["run", "--model", "nope"], ["run", "--batch", "0"],
               ["run", "--checkpoint", "/nonexistent"], ["plot", "/nonexistent.json"],
               ["run", "--out", __file__], ["frobnicate"]):
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (argv, p.stderr)


def test_help_does_not_import_jax():
  """Help, a bare `jfusedq` and the subcommands' help print without importing JAX (seconds)."""
  code = ("import sys; from models.cli import main\n"
          "try:\n  rc = main(sys.argv[1:])\nexcept SystemExit as e:\n  rc = e.code\n"
          "assert 'jax' not in sys.modules, 'jax imported'; sys.exit(rc)")
  for argv, rc in (([], 2), (["--help"], 0), (["run", "--help"], 0), (["plot", "-h"], 0)):
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == rc, (argv, p.stderr)
    assert "usage: jfusedq" in p.stdout, argv


def test_bare_command_shows_what_it_can_do(capsys):
  assert main([]) == 2
  out = capsys.readouterr().out
  assert all(cmd in out for cmd in ("run", "demo", "plot", "examples:"))
  assert "required" not in out


def test_internal_errors_keep_their_traceback(monkeypatch):
  def broken(*a, **kw):
    raise RuntimeError("a bug")
  monkeypatch.setattr(runner, "run", broken)
  with pytest.raises(RuntimeError, match="a bug"):
    main(["run", "--steps", "1"])


def test_help_lists_every_preset(capsys):
  with pytest.raises(SystemExit) as e:
    main(["run", "--help"])
  assert e.value.code == 0
  out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
  assert all(p in out for p in PRESETS) and "--out" in out
  assert "tensor-parallel devices (default 1)" in out and "simulates N CPU devices" in out
  assert "random weights and prompt (default 0)" in out


@pytest.mark.parametrize("content,want", [
    (None, "unreadable"), ("{", "unreadable"), ('{"rows": [{"x": 1}]}', "rows without"),
    ('{"rows": [1]}', "rows without"), ("[1, 2]", 'no list of "rows"'),
    ('{"model": "llama-tiny", "paths": {}}', "a `jfusedq run` result")])
def test_plot_bad_input(tmp_path, capsys, content, want):
  path = tmp_path / "r.json"
  if content is not None:
    path.write_text(content)
  assert main(["plot", str(path), "--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and want in err[0], err


def test_plot(tmp_path, capsys):
  """Every timed benchmark results file in the repository plots, into --out; one without
  times (the accuracy benchmark's NLL rows) is refused in one line."""
  files = sorted((ROOT / "benchmarks/results").glob("*.json"))
  timed = [f for f in files if all("time_us" in r for r in json.loads(f.read_text())["rows"])]
  assert timed and len(timed) < len(files)
  for results in files:
    if results not in timed:
      assert main(["plot", str(results), "--out", str(tmp_path)]) == 2, results
      assert "time_us" in capsys.readouterr().err
      continue
    assert main(["plot", str(results), "--out", str(tmp_path)]) == 0, results
    png = tmp_path / f"{results.stem}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_failed_rows_and_names_cases(tmp_path):
  """A failed check is drawn hatched; the keys that vary between cases label the groups."""
  import matplotlib.pyplot as plt
  runs = [("a", 1, "unfused", 10.0, True), ("a", 1, "fused", 9.0, True),
          ("b", 8, "unfused", 20.0, True), ("b", 8, "fused", 18.0, False)]
  rows = [dict(case=dict(preset=p, batch=b, tp=1), impl=impl, time_us=t, correct=ok)
          for p, b, impl, t, ok in runs]
  results = tmp_path / "decode.json"
  results.write_text(json.dumps(dict(benchmark="decode", device="X", jax="0", date="d",
                                     rows=rows)))
  assert main(["plot", str(results), "--out", str(tmp_path)]) == 0
  assert os.path.exists(tmp_path / "decode.png")
  fig = plt.gcf()
  ax = fig.axes[0]
  hatched = [round(b.get_height(), 3) for b in ax.patches if b.get_hatch()]
  assert hatched == [18.0]
  assert "check failed" in [t.get_text() for t in ax.get_legend().get_texts()]
  labels = ax.get_xticklabels()
  assert [t.get_text() for t in labels] == ["batch=1,preset=a", "batch=8,preset=b"]
  # Each label ends at its tick (under its bars), not centred on it.
  assert all(t.get_horizontalalignment() == "right" and t.get_rotation_mode() == "anchor"
             for t in labels)
  # The axis label lies inside the picture.
  box, page = ax.yaxis.label.get_window_extent(), fig.bbox
  assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
  plt.close("all")


def _results(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(benchmark="rmsnorm_quant", device="X", jax="0", date="d",
                                  rows=rows)))
  return str(path)


def test_plot_goes_next_to_its_results_or_where_out_says(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  rows = [dict(case=dict(T=1), impl="xla", time_us=2.0)]
  results = _results(tmp_path / "results" / "norm.json", rows)
  assert main(["plot", results]) == 0
  assert sorted(os.listdir(tmp_path / "results")) == ["norm.json", "norm.png"]
  assert main(["plot", results, "--out", str(tmp_path / "pictures" / "n.png")]) == 0
  assert os.listdir(tmp_path / "pictures") == ["n.png"]
  assert sorted(os.listdir(tmp_path)) == ["pictures", "results"]  # nothing in the current folder


def test_plot_draws_each_op_apart(tmp_path):
  """The norm benchmark times group_quant alone too (case "op"): another chart, another scale."""
  import matplotlib.pyplot as plt
  rows = [dict(case=dict(T=t, **op), impl=impl, time_us=t * 2.0) for t in (1, 64)
          for op in ({}, {"op": "group_quant"}) for impl in ("xla", "pallas")]
  assert main(["plot", _results(tmp_path / "rq.json", rows), "--out", str(tmp_path)]) == 0
  axes = plt.gcf().axes
  assert [ax.get_title() for ax in axes] == ["rmsnorm_quant", "group_quant"]
  assert [[t.get_text() for t in ax.get_xticklabels()] for ax in axes] == [["T=1", "T=64"]] * 2
  plt.close("all")


def test_plot_names_a_key_only_some_cases_have():
  """The bf16 side output (`hp`) and group_quant (`op`) cases of the norm benchmark."""
  from models.cli import case_labels
  cases = [dict(T=1, H=7168), dict(T=1, H=7168, hp=True), dict(T=1, H=7168, op="group_quant")]
  assert case_labels(cases) == ["", "hp=True", "op=group_quant"]


def test_demo(capsys):
  assert main(["demo", "--tokens", "4", "--hidden", "576", "--reps", "2"]) == 0
  out = capsys.readouterr().out
  assert "pallas vs xla: agree" in out
  pallas = next(line for line in out.splitlines() if line.strip().startswith("pallas:"))
  assert "Pallas runs in interpret mode on CPU" in pallas


@pytest.mark.parametrize("preset", ["deepseek-v3-deep", "qwen3.5-deep"])
def test_deep_presets_fit_one_h200(preset):
  """Many layers of the real shapes; bf16 masters and FP8 weights side by side fit 141 GB."""
  from models import registry
  size = lambda m: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(m)))
  hf = PRESETS[preset]
  bf16 = size(nnx.eval_shape(lambda: registry.build(hf, fp8=False)))
  fp8 = size(nnx.eval_shape(lambda: registry.build(hf, fp8=True)))
  shared = (1 + (not hf.get("tie_word_embeddings", False))) * hf["vocab_size"] * \
      hf["hidden_size"] * 2  # the bf16 embedding and head, one copy for every path
  assert hf["num_hidden_layers"] >= 24 and bf16 + fp8 - shared < 100e9


def test_library_input_errors_are_one_line(monkeypatch, capsys):
  """The library's own input errors (jfusedq.JfusedqError) end the same way as bad arguments."""
  from jfusedq import InputError

  def bad(*a, **kw):
    raise InputError("prompt_len must be an int >= 1, got 0")
  monkeypatch.setattr(runner, "run", bad)
  assert main(["run", "--steps", "1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["jfusedq: InputError: prompt_len must be an int >= 1, got 0"]


def test_device_time_needs_a_gpu_trace():
  """The profiler's kernel time per step comes from GPU planes only; a CPU trace has none."""
  assert runner.device_seconds(lambda: jnp.ones(8) * 2) is None
  assert runner.kernel_profile(lambda: jnp.ones(8) * 2) == (None, {})


def test_kernel_profile_sums_by_name_per_gpu(monkeypatch):
  """Kernel time summed over streams and averaged over the GPUs; the top kernels by name."""
  spans = [[(0, 3000, "a"), (3000, 4000, "b"), (5000, 8000, "a")], [(0, 2000, "a")]]
  monkeypatch.setattr(runner, "profile", lambda fn: fn())
  monkeypatch.setattr(runner, "gpu_kernels", lambda data: data)
  sec, top = runner.kernel_profile(lambda: spans, top=1)
  assert sec == pytest.approx(9000e-9 / 2) and top == {"a": 4.0}


def _gguf(tmp_path, arch: str = "llama") -> str:
  """llama-tiny as a GGUF file (random weights, two layers) whose metadata names `arch`."""
  pytest.importorskip("gguf", reason="the gguf package writes the GGUF file")
  from models import llama
  from tests.models.llama_files import tensors, write_gguf
  cfg = llama.LlamaConfig.from_hf(dict(PRESETS["llama-tiny"], num_hidden_layers=2))
  model = llama.LlamaForCausalLM(cfg, fp8=False, rngs=nnx.Rngs(0))
  return write_gguf(tmp_path / f"tiny-{arch}.gguf", cfg, tensors(model), arch=arch)


def test_run_gguf_checkpoint(tmp_path, capsys):
  path = _gguf(tmp_path)
  assert main(["run", "--checkpoint", path, "--batch", "1", "--prompt-len", "4", "--steps", "2",
               "--repeats", "2", "--out", str(tmp_path)]) == 0
  assert f"built {path} (2 layers)" in capsys.readouterr().err
  r = json.loads((tmp_path / "run_tiny-llama.json").read_text())
  assert list(r["paths"]) == ["bf16", "unfused", "fused"]
  for pair, a in r["numerics"].items():  # FP8 from the file's weights, not another draw
    assert a["kl"] < 0.2, pair


BAD_GGUF = {
    "no such file": (["--checkpoint", "/nonexistent/model.gguf"],
                     "checkpoint /nonexistent/model.gguf: no such file"),
    "not a GGUF file": (["--checkpoint", "{text}"], "not a GGUF file (it does not start with "),
    "another architecture": (["--checkpoint", "{qwen2}"],
                             "general.architecture is 'qwen2', not 'llama'"),
    "tp not dividing kv heads": (["--checkpoint", "{llama}", "--tp", "8"],
                                 "tensor parallelism over 8 devices needs "
                                 "num_key_value_heads=4 divisible by 8"),
}


@pytest.mark.parametrize("case", list(BAD_GGUF))
def test_bad_gguf_is_one_line_exit_2_before_building(tmp_path, capsys, monkeypatch, case):
  argv, want = BAD_GGUF[case]
  files = {"text": tmp_path / "text.gguf"}
  files["text"].write_text("a text file")
  if "{text}" not in argv and "/nonexistent/model.gguf" not in argv:
    files.update(qwen2=_gguf(tmp_path, "qwen2"), llama=_gguf(tmp_path))
  monkeypatch.setattr(runner, "run", lambda *a, **kw: pytest.fail("the model was built"))
  assert main(["run", *[a.format(**files) for a in argv]]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and want in err[0], err
  assert err[0].count(".gguf:") == 1, err  # the file is named once


def test_bad_gguf_path_is_reported_before_jax_is_imported(tmp_path):
  text = tmp_path / "text.gguf"
  text.write_text("a text file")
  code = ("import sys; from models.cli import main; rc = main(sys.argv[1:]); "
          "assert 'jax' not in sys.modules; sys.exit(rc)")
  for path in ("/nonexistent/model.gguf", str(text)):
    p = subprocess.run([sys.executable, "-c", code, "run", "--checkpoint", path], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (path, p.stderr)
