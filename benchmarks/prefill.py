"""Model-level prefill benchmark: a prompt of `tokens` tokens prefilled into an empty cache, per
path (fused, unfused: FP8; bf16: the masters, no FP8, all on one set of weights), preset, batch
and prompt length.

A prefill is the model's call as a server makes it, one jit: `model(tokens, cache=cache, pos=0,
chunk=C, logits="last")` with the weights, tokens and cache as arguments and the cache donated;
the prompt runs C tokens at a time into the cache (`models.common.CausalLM`), its attention
through `jfusedq.ops.attention` (cuDNN's flash attention on an NVIDIA GPU). `attention` in a row
names the attention backends the process had run by then (from the "jfusedq" log).

time_ms: the profiler's kernel time of one prefill on a GPU; elsewhere the wall time (the median
of --reps after a warm-up, as on CPU there is no kernel trace). tokens_per_s = batch * tokens /
time. compile_s: the prefill's compile. top_kernels (GPU): the twelve kernels taking the most
of time_ms, {name: us}: where a prefill's time goes.

roofline_frac = the prefill's floor / time (`models.cost`: projection FLOPs, the LM head once a
sequence, at the FP8 peak + attention FLOPs at the bf16 peak): one floor per case whatever the
path, so the rows' fractions compare as their speeds do. bf16 peak: XLA's bf16 dot at 8192^3,
measured in the run (`models.run.bf16_tflops`); the FP8 peak is taken as twice it.
peak_bytes: XLA's peak of the compiled prefill (`peak_memory_in_bytes` of its memory analysis:
weights, tokens and cache as arguments, temporaries, outputs); temp_bytes: the temporaries alone,
which grow with the chunk where the cache grows with the prompt.

Correctness: each path against the XLA path, the models' attention before the flash backends
(`jfusedq.implementations(attention="xla")`: every score materialised) on the whole prompt at
once (chunk None), holding the same weight arrays, at the largest of --tokens up to
--check-tokens (4096 by default: DeepSeek-V3's [B, 128, T, T] f32 scores take 8.6 GB a layer
there, 137 GB at 16384). There the path runs twice: as timed, and with chunks of a quarter of the
prompt, so the check also covers a cached prefix merged through the flash path's segments. Both
compare the last position's logits by relative RMS within `decode.xla_tol` (random weights
amplify a rounding difference layer by layer). A row is correct when its logits are finite, its
path passed that check (`checked_at`: the prompt length it ran at), and the attention op itself,
checked once per preset at the model's head shapes with a cached prefix of more than one segment
(`attention_vs_xla`: relative RMS, default backends against "xla", bf16), is within
ATTENTION_TOL.

Every row carries the `chunk` it ran with (default `models.common.PREFILL_CHUNK`). --chunks C1
C2 ...: every case once per chunk, written to prefill_chunks.json with the chunk in the case:
the measurement that sets PREFILL_CHUNK.

Run: python benchmarks/prefill.py [--presets deepseek-v3-deep qwen3.5-deep] [--batch 1]
     [--tokens 4096 16384 32768] [--paths fused unfused bf16] [--chunks C ...]
     [--check-tokens 4096] [--reps 3] [--tag TAG] [--out DIR] [--commit SHA] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
import jfusedq  # noqa: E402
from decode import xla_tol  # noqa: E402
from jfusedq.ops.attention import SEGMENT, Prefix, attention  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import cost  # noqa: E402
from models import run as runner  # noqa: E402
from models.common import PREFILL_CHUNK  # noqa: E402

PATHS = ("fused", "unfused", "bf16")
# The attention op's default backends against its XLA reference in bf16: cuDNN rounds each
# segment's output to bf16 (2**-9 relative) and both round the probabilities to bf16 against a
# different maximum (measured 2e-3 for the blocked backend on CPU); a missed or doubled segment
# is >= 5% off.
ATTENTION_TOL = 1e-2


class Backends(logging.Handler):
  """The attention backends the "jfusedq" logger reports as run."""

  def __init__(self):
    super().__init__()
    self.seen: set[str] = set()

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith("attention: implementation "):
      self.seen.add(msg.split()[2])


def attention_check(cfg, t: int, cached: int) -> float:
  """The attention op's default backends against "xla" at the model's head shapes, bf16, with
  `t` new tokens over `cached` positions: relative RMS."""
  hq, hkv, d, dv = cost.head_shapes(cfg)
  ks = jax.random.split(jax.random.key(0), 5)
  f = lambda key, *s: jax.random.normal(key, s, jnp.bfloat16)
  q, k, v = f(ks[0], 1, t, hq, d), f(ks[1], 1, t, hkv, d), f(ks[2], 1, t, hkv, dv)
  ck, cv = f(ks[3], 1, cached, hkv, d), f(ks[4], 1, cached, hkv, dv)
  fetch = lambda start, size: (lax.dynamic_slice_in_dim(ck, start, size, axis=1),
                               lax.dynamic_slice_in_dim(cv, start, size, axis=1))
  run = jax.jit(lambda q, k, v, impl=None: attention(
      q, k, v, scale=d**-0.5, prefix=Prefix(fetch, cached, cached), implementation=impl),
      static_argnames="impl")
  return rel_rms(run(q, k, v), run(q, k, v, "xla"))


def prefill_fn(model: nnx.Module, chunk: int | None, logits: str = "last"):
  """(jitted prefill(params, tokens, cache) -> (logits, cache), params): the model's call at
  pos 0 with the cache donated."""
  graphdef, state = nnx.split(model)
  flat, tree = jax.tree.flatten(state)

  def prefill(params, tokens, cache):
    m = nnx.merge(graphdef, jax.tree.unflatten(tree, params))
    return m(tokens, cache=cache, pos=0, chunk=chunk, logits=logits)

  return jax.jit(prefill, donate_argnums=2), flat


def last_logits(model, tokens, chunk, reference: bool = False) -> np.ndarray:
  """The last position's logits of one prefill of `tokens`; `reference`: on the XLA attention,
  the prompt at once."""
  with jfusedq.implementations(attention="xla" if reference else None):
    fn, params = prefill_fn(model, None if reference else chunk)
    out, _ = fn(params, tokens, runner.new_cache(model, *tokens.shape))
  return np.asarray(out, np.float32)


def time_prefill(model, tokens, chunk, reps: int) -> dict:
  """Compile and time one prefill (module docstring): seconds, compile seconds, memory, and the
  last position's logits."""
  fn, params = prefill_fn(model, chunk)
  b, t = tokens.shape
  cache = runner.new_cache(model, b, t)
  t0 = time.perf_counter()
  compiled = fn.lower(params, tokens, cache).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  out, cache = compiled(params, tokens, cache)  # warm-up
  jax.block_until_ready(out)
  walls = []
  for _ in range(reps):
    cache = runner.new_cache(model, b, t)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    out, cache = compiled(params, tokens, cache)
    jax.block_until_ready(out)
    walls.append(time.perf_counter() - t0)
  holder = [runner.new_cache(model, b, t)]

  def traced():
    out, holder[0] = compiled(params, tokens, holder[0])
    return out

  kernel_s, top = (runner.kernel_profile(traced) if jax.devices()[0].platform == "gpu"
                   else (None, {}))
  del cache, holder
  return dict(sec=kernel_s or statistics.median(walls), wall_s=statistics.median(walls),
              kernel_s=kernel_s, top_kernels=top or None, compile_s=compile_s,
              peak_bytes=mem.peak_memory_in_bytes, temp_bytes=mem.temp_size_in_bytes,
              logits=np.asarray(out, np.float32))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", nargs="+", default=["deepseek-v3-deep", "qwen3.5-deep"])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 32768])
  ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
  ap.add_argument("--chunks", nargs="+", type=int, default=[PREFILL_CHUNK],
                  help="prefill chunks to time (module docstring)")
  ap.add_argument("--check-tokens", type=int, default=4096,
                  help="the longest prompt the XLA reference runs at")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--tag", default="", help="results file prefill_<tag>.json")
  ap.add_argument("--smoke", action="store_true", help="tiny presets, to check the script on CPU")
  args = ap.parse_args()
  if args.smoke:
    args.presets = [p.replace("-deep", "-tiny").replace("-layers", "-tiny") for p in args.presets]
    args.tokens, args.chunks, args.check_tokens = [20, 37], [16], 37
  backends = Backends()
  logging.getLogger("jfusedq").addHandler(backends)
  logging.getLogger("jfusedq").setLevel(logging.INFO)
  bf16 = runner.bf16_tflops(256 if args.smoke else 8192)
  fp8 = cost.FP8_PER_BF16 * bf16
  peaks = {"bf16_tflops": round(bf16, 1), "fp8_tflops": round(fp8, 1)}
  print(f"bf16 dot {bf16:.1f} TFLOP/s; FP8 peak taken as {fp8:.1f}")
  # The reference's prompt length first: its rows hold the check the longer ones rely on.
  check_at = max((t for t in args.tokens if t <= args.check_tokens), default=None)
  tokens = sorted(args.tokens, key=lambda t: (t != check_at, t))
  sweep = len(args.chunks) > 1
  name = ("prefill_chunks" if sweep else "prefill") + (f"_{args.tag}" if args.tag else "")
  rows = []
  print(f"{'preset':>18} {'B':>2} {'tokens':>6} {'chunk':>6} {'path':>8} {'ms':>10} "
        f"{'tok/s':>10} {'roof':>5} {'peak GB':>8} {'temp GB':>8} ok")
  for preset in args.presets:
    if preset not in runner.PRESETS:
      print(f"{preset}: not a preset here, skipped")
      continue
    built = runner.build(preset, master="bf16" in args.paths)
    cfg = built.model.cfg
    # More cached keys than one cuDNN segment holds, the last segment partial.
    cached = 67 if args.smoke else SEGMENT + 904
    att = attention_check(cfg, 24 if args.smoke else 512, cached)
    print(f"{preset}: attention op vs xla {att:.2e} (bf16, {cached} cached)")
    prompts = {t: jax.random.randint(jax.random.key(t), (args.batch, t), 0, cfg.vocab_size,
                                     jnp.int32) for t in tokens}
    refs, checks = {}, {}  # path -> the reference's logits; the worst distance from them
    if check_at is not None:
      toks = prompts[check_at]
      for path in args.paths:
        model = built.path(path)
        refs[path] = last_logits(model, toks, None, reference=True)
        checks[path] = rel_rms(last_logits(model, toks, max(1, check_at // 4)), refs[path])
        print(f"{preset}: {path} in chunks of {max(1, check_at // 4)} vs the XLA path at "
              f"{check_at} tokens: {checks[path]:.3e}")
    tol = xla_tol(built.layers)
    for t in tokens:
      for chunk in args.chunks:
        for path in args.paths:
          model = built.path(path)
          r = time_prefill(model, prompts[t], chunk, args.reps)
          if t == check_at:
            checks[path] = max(checks[path], rel_rms(r["logits"], refs[path]))
          proj, attn = cost.prefill_flops(model, args.batch, t, logits="last")
          roof = cost.prefill_floor(proj, attn, bf16)
          checked = checks.get(path)
          ok = (bool(np.isfinite(r["logits"]).all()) and checked is not None and checked <= tol
                and att <= ATTENTION_TOL)
          case = dict(preset=preset, batch=args.batch, tokens=t)
          rows.append(dict(
              case=dict(case, chunk=chunk) if sweep else case, impl=path, chunk=chunk,
              time_ms=round(r["sec"] * 1e3, 3), tokens_per_s=round(args.batch * t / r["sec"], 1),
              roofline_frac=round(roof / r["sec"], 4), peak_bytes=r["peak_bytes"],
              temp_bytes=r["temp_bytes"], correct=ok, checked_at=check_at,
              logits_rel_rms_vs_xla=None if checked is None else round(checked, 6),
              attention_vs_xla=round(att, 6), attention=sorted(backends.seen),
              projection_flops=proj, attention_flops=attn,
              wall_ms=round(r["wall_s"] * 1e3, 3),
              kernel_ms=r["kernel_s"] and round(r["kernel_s"] * 1e3, 3),
              top_kernels=r["top_kernels"],
              compile_s=round(r["compile_s"], 2)))
          print(f"{preset:>18} {args.batch:>2} {t:>6} {chunk:>6} {path:>8} "
                f"{r['sec'] * 1e3:10.2f} {args.batch * t / r['sec']:10.1f} "
                f"{roof / r['sec']:5.2f} {r['peak_bytes'] / 1e9:8.2f} "
                f"{r['temp_bytes'] / 1e9:8.2f} {'yes' if ok else 'NO'}", flush=True)
          # after every row: a run cut off by a time limit keeps what it finished
          _harness.write_results(name, rows, peaks, args.commit, args.out)
    del built  # the next preset's weights need the memory
  if not rows:
    _harness.write_results(name, rows, peaks, args.commit, args.out)


if __name__ == "__main__":
  main()
