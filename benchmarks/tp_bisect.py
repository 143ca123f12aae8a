"""Which kernel makes a tensor-parallel model step disagree with its XLA build: a bisection.

Builds `--preset` at `--tp` (fused path), runs one decode step of batch `--batch` with every
op on its default GPU backend, then again with one op at a time forced to XLA (through
`jfusedq.implementations`), each against the whole model on XLA (same weights, tokens, cache):
the op whose forcing closes the gap is the culprit. Every Triton `fp8_matmul` /
`grouped_fp8_matmul` call the step traced is then run alone on fresh random inputs of its exact
shapes, layout and tiling, against the reference.

Run: python benchmarks/tp_bisect.py [--preset qwen3.5-layers] [--tp 2] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jfusedq import implementations  # noqa: E402
from jfusedq.fp8 import E4M3FN, QuantizedActivation  # noqa: E402
from jfusedq.ops.fp8_matmul import reference, triton  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import run as runner  # noqa: E402

OPS = ("fp8_matmul", "grouped_fp8_matmul", "rmsnorm_quant", "rmsnorm", "group_quant")
calls: dict[str, tuple] = {}  # str(shapes and static args) -> (kernel, the call's args)


def _record():
  """Wraps the Triton GEMMs to keep one call of each shape, layout and tiling."""
  for name in ("fp8_matmul", "grouped_fp8_matmul"):
    orig = getattr(triton, name)

    def record(*args, _orig=orig, _name=name):
      key = (_name,) + tuple(getattr(x, "shape", x) for x in args if x is not None)
      calls.setdefault(str(key), (_name, args))
      return _orig(*args)
    setattr(triton, name, record)


def _alone(name, args):
  """The recorded Triton call on fresh inputs of its shapes, against the reference."""
  ks = iter(jax.random.split(jax.random.key(7), 9))
  rand = lambda x, dt: (jax.random.normal(next(ks), x.shape, jnp.float32) * 2).astype(dt)
  if name == "fp8_matmul":
    qa, sa, layout, qw, sw, cfg, out_dtype = args
    qa, qw = rand(qa, E4M3FN), rand(qw, E4M3FN)
    sa = jax.random.uniform(next(ks), sa.shape, jnp.float32, 0.01, 0.1)
    sw = jax.random.uniform(next(ks), sw.shape, jnp.float32, 0.01, 0.1)
    got = jax.jit(lambda *x: triton.fp8_matmul(*x[:2], layout, *x[2:], cfg, out_dtype))(
        qa, sa, qw, sw)
    m = qa.shape[0]
    s_row = sa if layout == "row" else sa.T
    want = reference.fp8_matmul(QuantizedActivation(qa, s_row.reshape(m, -1)), qw, sw,
                                jnp.float32)
  else:
    q3, s3, layout, w, ws, ids, cfg, out_dtype = args
    q3, w = rand(q3, E4M3FN), rand(w, E4M3FN)
    s3 = jax.random.uniform(next(ks), s3.shape, jnp.float32, 0.01, 0.1)
    ws = jax.random.uniform(next(ks), ws.shape, jnp.float32, 0.01, 0.1)
    # The recorded arguments are the step's tracers: only their shapes are reused.
    ids = None if ids is None else jax.random.randint(next(ks), ids.shape, 0, w.shape[0])
    got = jax.jit(lambda q3, s3, w, ws: triton.grouped_fp8_matmul(
        q3, s3, layout, w, ws, ids, cfg, out_dtype))(q3, s3, w, ws)
    b = got.shape[0]
    e = jnp.arange(b) if ids is None else ids
    g = jnp.arange(b) // (b // q3.shape[0])
    want = jax.vmap(lambda q, s, w, ws: reference.fp8_matmul(
        QuantizedActivation(q, s), w, ws, jnp.float32))(q3[g], s3[g], w[e], ws[e])
  return float(rel_rms(got, want))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3.5-layers")
  ap.add_argument("--tp", type=int, default=2)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=256)
  args = ap.parse_args()
  _record()
  built = runner.build(args.preset, tp=args.tp)
  ref = runner.build(args.preset, tp=args.tp, implementation="xla")
  b, ctx = args.batch, args.context
  tok = jax.random.randint(jax.random.key(b), (b, 1), 0, built.model.cfg.vocab_size, jnp.int32)

  def logits(bt):
    fwd, params = runner.forward_fn(bt.model, args.tp)
    return fwd(params, tok, bt.model.init_cache(b, ctx + 1), jnp.int32(ctx))[0]

  want = logits(ref)
  for force in [()] + [(op,) for op in OPS]:
    jax.clear_caches()  # the override is read at trace time
    with implementations(**{op: "xla" for op in force}):
      got = logits(built)
    print(f"forced to xla {force or '(none)'}: rel rms vs xla model "
          f"{float(rel_rms(got, want)):.4f}", flush=True)
  for key, (name, a) in calls.items():
    err = _alone(name, a)
    print(f"alone: rel rms vs reference {err:.2e}  {key}", flush=True)


if __name__ == "__main__":
  main()
