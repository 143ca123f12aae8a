"""The numerics ranges `jfusedq run` prints beside its random-weight figures (`EXPECTED` in
models/run.py): per preset and path pair, KL(reference || path) and top-1 agreement of the
teacher-forced prefill logits at `models.run.RANGE_BATCH` x `RANGE_PROMPT` (the run's defaults,
2 x 16), lowest and highest over seeds.

Each seed builds the preset's weights and prompt as `jfusedq run --seed S` does (bf16 masters,
FP8 paths holding them quantised) and prefills that prompt on every path; each path's prefill
is compiled once and re-run on every seed's weights. Prints each preset's `EXPECTED` entry, the
lows rounded down and the highs up to two significant digits.

Run: python benchmarks/expected_ranges.py [--presets deepseek-v3-tiny ...] [--seeds 16]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from models import run as runner  # noqa: E402


def seed_figures(preset: str, seeds: int, batch: int = runner.RANGE_BATCH,
                 prompt_len: int = runner.RANGE_PROMPT,
                 steps: int = 32) -> dict[tuple[str, str], list[dict]]:
  """{(reference, path): [runner.agreement of seed 0, 1, ...]} over `seeds` seeds."""
  compiled = {}
  figures = {pair: [] for pair in runner.PAIRS}
  for seed in range(seeds):
    built = runner.build(preset, seed=seed)
    models = {p: built.path(p) for p in runner.PATHS}
    tokens = runner.prompt(models["bf16"].cfg.vocab_size, batch, prompt_len, seed)
    logits = {}
    for name, model in models.items():
      forward, params = runner.forward_fn(model, 1)
      # the run's cache: room for its decode steps after the prompt
      cache = runner.new_cache(model, batch, prompt_len + steps)
      if name not in compiled:
        prefill, _ = runner.step_fns(forward)
        compiled[name] = prefill.lower(params, tokens, cache).compile()
      logits[name] = np.asarray(compiled[name](params, tokens, cache)[0], np.float32)
      del forward, params, cache
    for a, b in runner.PAIRS:
      figures[a, b].append(runner.agreement(logits[a], logits[b]))
    del built, models  # the next seed's weights need the memory
    print(f"{preset} seed {seed}: " + ", ".join(
        f"{a}->{b} KL {figures[a, b][-1]['kl']:.2e} top-1 {figures[a, b][-1]['top1']:.3f}"
        for a, b in runner.PAIRS), flush=True)
  return figures


def outward(x: float, up: bool) -> float:
  """`x` to two significant digits, rounded up or down."""
  if x == 0:
    return 0.0
  scale = 10.0 ** (math.floor(math.log10(abs(x))) - 1)
  return (math.ceil(x / scale) if up else math.floor(x / scale)) * scale


def entry(figures: dict[tuple[str, str], list[dict]]) -> dict:
  """`EXPECTED[preset]`: (KL low, KL high, top-1 low, top-1 high) per pair."""
  out = {}
  for pair, runs in figures.items():
    kl = [r["kl"] for r in runs]
    top = [r["top1"] for r in runs]
    out[pair] = (outward(min(kl), False), outward(max(kl), True),
                 math.floor(min(top) * 100) / 100, math.ceil(max(top) * 100) / 100)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", nargs="+", default=["deepseek-v3-tiny"],
                  choices=sorted(runner.PRESETS))
  ap.add_argument("--seeds", type=int, default=16)
  args = ap.parse_args()
  for preset in args.presets:
    e = entry(seed_figures(preset, args.seeds))
    body = ",\n".join(f"    {pair!r}: ({v[0]:.2g}, {v[1]:.2g}, {v[2]:.2f}, {v[3]:.2f})"
                      for pair, v in e.items())
    print(f'"{preset}": {{  # seeds 0-{args.seeds - 1}, {jax.devices()[0].device_kind}\n'
          f"{body}}},", flush=True)


if __name__ == "__main__":
  main()
