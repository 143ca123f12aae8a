"""The main job: build a model, run a jit-compiled prefill then decode steps, fused and unfused,
and report compile time, latency, throughput, kernels per step and their agreement.

Kernels per decode step are counted from the compiled HLO (`jfusedq.hlo`); the per-layer
saving of the fused path is (unfused - fused) / layers.
Latencies are wall clock around each jitted call (dispatch included): the device-time figures
for GPUs come from `benchmarks/decode.py`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfusedq import default_format
from jfusedq.hlo import kernel_counts
from models import registry
from models.common import tp_apply
from models.presets import PRESETS


@dataclasses.dataclass
class Built:
  """A model and how to rebuild it with another fused setting (the same weights)."""

  model: nnx.Module
  make: Callable[[bool], nnx.Module]

  @property
  def layers(self) -> int:
    return len(self.model.layers)


def build(preset: str | None = None, checkpoint: str | None = None, *, fp8: bool = True,
          fused: bool = True, tp: int = 1, dtype=jnp.bfloat16, seed: int = 0,
          implementation: str | Sequence[str] | None = None) -> Built:
  """A model from a preset (random weights from `seed`) or a Hugging Face checkpoint, built
  for `tp` tensor-parallel devices (mesh axis "tp"); `implementation` is passed to every op
  the model runs (None: each op's best)."""
  if not checkpoint and preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
  kw = dict(fp8=fp8, dtype=dtype, tp_axis="tp" if tp > 1 else None,
            implementation=implementation)

  def make(fused: bool) -> nnx.Module:
    if checkpoint:
      return registry.from_pretrained(checkpoint, fused=fused, **kw)
    return registry.build(PRESETS[preset], seed=seed, fused=fused, **kw)

  return Built(make(fused), make)


def forward_fn(model: nnx.Module, tp: int):
  """`(forward(params, tokens, cache, pos) -> (logits, cache), params)` for `model` on `tp`
  devices. The weights are an argument, never a closure: a jit would capture closed-over
  arrays as constants of the program (gigabytes for the `-layers` presets, and a compile that
  never ends). `params` is the model state as a flat list of arrays, unflattened inside the
  jit: an nnx.State argument is flattened by Python at every call (110-210 us a call for the
  tiny presets against 37-52 us for the list, on this CPU), which a decode step pays on the
  host each time it is launched."""
  if tp > 1:
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    apply, state = tp_apply(model, mesh, with_cache=True, explicit_params=True)
  else:
    graphdef, state = nnx.split(model)
    apply = lambda params, tokens, cache, pos: nnx.merge(graphdef, params)(
        tokens, cache=cache, pos=pos)
  flat, tree = jax.tree.flatten(state)

  def forward(params, tokens, cache, pos):
    return apply(jax.tree.unflatten(tree, params), tokens, cache, pos)

  return forward, flat


def _progress(i: int, n: int, label: str) -> None:
  if sys.stderr.isatty():
    done = int(30 * i / n)
    sys.stderr.write(f"\r{label:>8} [{'#' * done}{'.' * (30 - done)}] {i}/{n}")
    if i == n:
      sys.stderr.write("\n")
    sys.stderr.flush()


def run_one(built: Built, fused: bool, tokens: jax.Array, steps: int, tp: int,
            forced: np.ndarray | None = None) -> dict:
  """Prefill `tokens [B, T]`, then `steps` greedy decode steps (or the `forced` tokens)."""
  model = built.model if fused else built.make(False)
  b, t = tokens.shape
  forward, params = forward_fn(model, tp)
  prefill = jax.jit(lambda params, tok, cache: forward(params, tok, cache, 0))
  decode = jax.jit(forward)
  cache = model.init_cache(b, t + steps)
  t0 = time.perf_counter()
  prefill_c = prefill.lower(params, tokens, cache).compile()
  decode_c = decode.lower(params, tokens[:, :1], cache, jnp.int32(t)).compile()
  compile_s = time.perf_counter() - t0
  counts = kernel_counts(decode_c.as_text())

  t0 = time.perf_counter()
  logits, cache = jax.block_until_ready(prefill_c(params, tokens, cache))
  prefill_s = time.perf_counter() - t0
  last = [np.asarray(logits[:, -1], np.float32)]
  chosen, step_s = [], []
  for i in range(steps):
    nxt = (jnp.argmax(logits[:, -1], axis=-1) if forced is None
           else jnp.asarray(forced[:, i])).astype(tokens.dtype)
    chosen.append(np.asarray(nxt))
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(decode_c(params, nxt[:, None], cache,
                                                   jnp.int32(t + i)))
    step_s.append(time.perf_counter() - t0)
    last.append(np.asarray(logits[:, -1], np.float32))
    _progress(i + 1, steps, "fused" if fused else "unfused")
  decode_s = float(np.median(step_s)) if step_s else float("nan")
  return dict(fused=fused, compile_s=compile_s, prefill_ms=prefill_s * 1e3,
              decode_ms=decode_s * 1e3, tokens_per_s=b / decode_s if step_s else None,
              kernels=counts, logits=np.stack(last, 1), tokens=np.stack(chosen, 1) if chosen
              else np.zeros((b, 0), np.int32))


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
  """Top-1 agreement and KL(a || b) (nats per position) of two logit sets `[B, S, V]`."""
  top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
  la = a - a.max(-1, keepdims=True)
  la = la - np.log(np.exp(la).sum(-1, keepdims=True))
  lb = b - b.max(-1, keepdims=True)
  lb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
  kl = float(np.mean(np.sum(np.exp(la) * (la - lb), -1)))
  return dict(top1=top1, kl=kl, max_abs_diff=float(np.abs(a - b).max()))


def run(preset=None, checkpoint=None, *, batch=2, prompt_len=16, steps=8, tp=1, compare=True,
        fp8=True, seed=0) -> dict:
  built = build(preset, checkpoint, fp8=fp8, tp=tp, seed=seed)
  vocab = built.model.cfg.vocab_size
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, prompt_len), 0, vocab, jnp.int32)
  fused = run_one(built, True, tokens, steps, tp)
  result = dict(model=preset or checkpoint, platform=jax.devices()[0].platform,
                device=jax.devices()[0].device_kind, tp=tp, batch=batch, prompt_len=prompt_len,
                steps=steps, layers=built.layers, fused=fused)
  if tp > 1:
    from jfusedq import parallel
    h = built.model.cfg.hidden_size
    spec = jax.ShapeDtypeStruct((batch, 1, h), jnp.bfloat16)
    result["allreduce_strategy"] = parallel.chosen_strategy(
        spec, jax.ShapeDtypeStruct((h,), jnp.bfloat16), residual=spec,
        fmt=default_format(), keep_bf16=True)
  if compare:
    # The unfused run is fed the fused run's tokens, so every position is compared.
    unfused = run_one(built, False, tokens, steps, tp, forced=fused["tokens"])
    result["unfused"] = unfused
    result["agreement"] = agreement(fused["logits"], unfused["logits"])
    result["kernels_saved_per_layer"] = (unfused["kernels"]["total"] -
                                         fused["kernels"]["total"]) / built.layers
  return result


def table(r: dict) -> str:
  runs = [r["fused"]] + ([r["unfused"]] if "unfused" in r else [])
  lines = [f"{r['model']} on {r['platform']} ({r['device']}), tp={r['tp']}, batch {r['batch']},"
           f" prompt {r['prompt_len']}, {r['steps']} decode steps, {r['layers']} layers"]
  head = (f"{'path':>8} {'compile s':>9} {'prefill ms':>10} {'decode ms':>9} {'tok/s':>8} "
          f"{'kernels/step':>12} {'fusion':>6} {'custom':>6} {'coll':>4}")
  lines += [head, "-" * len(head)]
  for x in runs:
    k = x["kernels"]
    lines.append(f"{'fused' if x['fused'] else 'unfused':>8} {x['compile_s']:9.2f} "
                 f"{x['prefill_ms']:10.2f} {x['decode_ms']:9.2f} {x['tokens_per_s'] or 0:8.1f} "
                 f"{k['total']:12d} {k['fusion']:6d} {k['custom-call']:6d} {k['collective']:4d}")
  if "agreement" in r:
    a = r["agreement"]
    lines.append(f"kernels per layer saved by the fused path: {r['kernels_saved_per_layer']:+.2f}")
    lines.append(f"fused vs unfused logits: top-1 agreement {a['top1']:.3f}, KL {a['kl']:.2e} "
                 f"nats, max |diff| {a['max_abs_diff']:.3g}")
  if "allreduce_strategy" in r:
    lines.append(f"all-reduce strategy at prepare_attn: {r['allreduce_strategy']}")
  return "\n".join(lines)


def to_json(r: dict) -> dict:
  """`r` without the raw logits and tokens."""
  drop = ("logits", "tokens")
  return {k: ({kk: vv for kk, vv in v.items() if kk not in drop} if isinstance(v, dict) else v)
          for k, v in r.items()}
