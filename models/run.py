"""The main job: one set of master weights run three ways (bf16, FP8 unfused, FP8 fused), each a
jit-compiled prefill then greedy decode steps as a serving loop runs them, with per-step times,
kernels per step and the FP8 paths' numerics against bf16.

Weights: a preset builds bf16 masters from `seed`; the FP8 paths hold those masters quantised
to 128 x 128 blocks (`quantize`), the fused and unfused paths the very same arrays. A
checkpoint loads its masters (FP8 weights dequantised) for bf16 and its FP8 weights as stored.

Decode loop: the model state is split once into a flat list of arrays; a call takes (params,
tokens, cache, pos), runs up to 8 greedy steps (`chunk_for`), each picking the next token on the
device (argmax inside the jit), and donates the tokens, cache and position, so a round of
`steps` steps is launched back to back with no host sync until its end, each call reading and
writing the buffers the last one did.
Per path: `repeats` rounds after a warm-up one; step time = round wall time / steps (median and
p10-p90 over rounds), host enqueue time = the launching loop's time / steps. On a GPU the
profiler's kernel time per step is added (`device_ms`). On CPU these are XLA:CPU times of a
host-bound program, not kernel speeds. The prefill's first call gives the numerics' logits and
the cache decode starts from; a second, into a new cache, is timed (`prefill_ms`, wall clock),
and on a GPU a third under the profiler (`prefill_device_ms`).

Rooflines (`models.cost`), on one GPU: before the build the device's copy bandwidth and bf16
dot are measured (`peaks`); a path's prefill kernel time is held to the FLOPs it must compute
(`prefill_roofline_frac`: projections at the FP8 peak, attention at the bf16 one) and its decode
kernel time per step to the bytes a step must read (`roofline_frac`: the weights it touches and
the cache, at copy bandwidth). Null on CPU (no kernel times, no meaningful peak) and under TP
(the weights' split over the devices is the model's own, not counted).

Numerics: teacher-forced, the prefill's logits over one fixed token sequence, per position:
KL(reference || path) and top-1 agreement, with the range measured for the preset (EXPECTED):
with random weights a check that each path runs as it should, not what FP8 costs. That is the
trained model's figure (`fp8_cost`: the NLL delta over bf16 that `benchmarks/accuracy.py`
measured), printed beside them. Kernels per decode step are counted from the compiled HLO
(`jfusedq.hlo`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfusedq import default_format
from jfusedq.errors import InputError
from jfusedq.hlo import kernel_counts
from jfusedq.nn import quantize_weight
from models import cost, registry
from models.common import tp_apply
from models.presets import PRESETS

PATHS = ("bf16", "unfused", "fused")
PAIRS = (("bf16", "unfused"), ("bf16", "fused"), ("unfused", "fused"))

# (reference, path) -> (KL low, KL high, top-1 low, top-1 high), teacher-forced at RANGE_BATCH x
# RANGE_PROMPT (the run's defaults; a run of another size prints none): the min and max of those
# figures over seeds, as benchmarks/expected_ranges.py measures them: the tiny presets over
# seeds 0-15 on CPU (XLA), the -layers presets over seeds 0-7 and the -deep ones over seeds 0-3
# on the H200 (the GPU kernels). The random weights amplify one rounding layer by layer (the MoE
# presets' KL is 2-35x the dense Llama's), so fused vs unfused moves as much as FP8 vs bf16
# here; a trained model's figures are the accuracy reference (`fp8_cost`).
RANGE_BATCH, RANGE_PROMPT = 2, 16
EXPECTED = {
    "deepseek-v3-tiny": {("bf16", "unfused"): (1.7e-2, 8.4e-2, 0.53, 0.82),
                         ("bf16", "fused"): (1.4e-2, 6.3e-2, 0.56, 0.85),
                         ("unfused", "fused"): (1.2e-2, 4.6e-2, 0.53, 0.94)},
    "qwen3.5-tiny": {("bf16", "unfused"): (1.0e-2, 2.9e-2, 0.59, 0.85),
                     ("bf16", "fused"): (7.2e-3, 3.0e-2, 0.50, 0.88),
                     ("unfused", "fused"): (4.7e-3, 2.0e-2, 0.59, 0.91)},
    "llama-tiny": {("bf16", "unfused"): (2.3e-3, 2.9e-3, 0.78, 0.97),
                   ("bf16", "fused"): (2.5e-3, 3.0e-3, 0.78, 0.97),
                   ("unfused", "fused"): (1.4e-3, 1.8e-3, 0.81, 1.00)},
    "deepseek-v3-layers": {("bf16", "unfused"): (1.7e-2, 2.4e-2, 0.46, 0.72),
                           ("bf16", "fused"): (1.4e-2, 2.4e-2, 0.37, 0.72),
                           ("unfused", "fused"): (1.1e-2, 1.5e-2, 0.50, 0.69)},
    "qwen3.5-layers": {("bf16", "unfused"): (4.9e-3, 6.1e-3, 0.75, 0.85),
                       ("bf16", "fused"): (4.7e-3, 5.9e-3, 0.68, 0.88),
                       ("unfused", "fused"): (2.1e-3, 2.8e-3, 0.78, 0.91)},
    "deepseek-v3-deep": {("bf16", "unfused"): (7.9e-2, 8.7e-2, 0.28, 0.44),
                         ("bf16", "fused"): (8.4e-2, 8.8e-2, 0.21, 0.29),
                         ("unfused", "fused"): (6.6e-2, 7.7e-2, 0.28, 0.47)},
    "qwen3.5-deep": {("bf16", "unfused"): (1.2e-3, 2.0e-3, 0.81, 1.00),
                     ("bf16", "fused"): (1.2e-3, 2.0e-3, 0.87, 1.00),
                     ("unfused", "fused"): (2.9e-4, 5.0e-4, 0.87, 1.00)},
}


def expected_range(preset: str | None, pair: tuple[str, str]) -> dict | None:
  """EXPECTED's range for `pair` of `preset` as named fields (None where none was measured)."""
  r = EXPECTED.get(preset, {}).get(pair)
  return None if r is None else dict(zip(("kl_low", "kl_high", "top1_low", "top1_high"), r))


def at_range_size(batch: int, prompt_len: int) -> bool:
  """Whether a run of this size is the one EXPECTED's ranges were measured at."""
  return (batch, prompt_len) == (RANGE_BATCH, RANGE_PROMPT)


# What FP8 costs on a trained model: the accuracy benchmark's results, in a checkout.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCURACY = os.path.join(CHECKOUT, "benchmarks", "results", "accuracy.json")


def checkout_commit() -> str | None:
  """The commit of the checkout this code runs from, "-dirty" appended when its tracked files
  differ from it (git describe); None outside a git checkout or without git."""
  try:
    p = subprocess.run(["git", "-C", CHECKOUT, "describe", "--always", "--dirty"],
                       capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return (p.stdout.strip() or None) if p.returncode == 0 else None


def fp8_cost(fmt: str, path: str = ACCURACY) -> dict | None:
  """The trained-model reference for the FP8 paths in format `fmt`, from the accuracy
  benchmark's results: {"case" (its model, text and tokens), "commit", "date", "device",
  "bf16_nll", "unfused"/"fused": {"nll_delta": NLL - bf16 NLL, "se": its standard error}} on
  the case with the most tokens that has `fmt` rows, with the XLA ops and amax scales, and that
  case's own run; None where the file (a checkout's) is absent or has no such rows."""
  try:
    with open(path) as f:
      doc = json.load(f)
  except (OSError, ValueError):
    return None
  by_case: dict[str, list[dict]] = {}
  for r in doc.get("rows", ()):
    if r.get("implementation") == "xla" and not r.get("ue8m0"):
      by_case.setdefault(json.dumps(r["case"], sort_keys=True), []).append(r)
  # The case with the most tokens that measured both bf16 and `fmt`.
  for main in sorted(by_case.values(), key=lambda rs: -rs[0]["case"]["tokens"]):
    bf16 = next((r for r in main if r["format"] is None), None)
    fp8 = {("fused" if r["fused"] else "unfused"): dict(nll_delta=r["delta_vs_bf16"],
                                                        se=r["delta_se"])
           for r in main if r["format"] == fmt}
    if bf16 is not None and fp8:
      run = lambda key: bf16.get(key, doc.get(key))
      return dict(case=bf16["case"], commit=run("commit"), date=run("date"),
                  device=run("device"), bf16_nll=bf16["nll"], **fp8)
  return None


@dataclasses.dataclass
class Built:
  """A model's paths over one set of weights. `model`: the path `build` was asked for;
  `make(fused, fp8=..., implementation=...)`: another path (or the same on other kernels),
  sharing `master` (bf16) or the FP8 arrays."""

  model: nnx.Module
  make: Callable[..., nnx.Module]
  master: nnx.Module | None = None

  @property
  def layers(self) -> int:
    return len(self.model.layers)

  def path(self, name: str, implementation=None) -> nnx.Module:
    """The model of path `name` (one of PATHS) over these weights."""
    return self.make(name == "fused", fp8=name != "bf16", implementation=implementation)


def quantize(master: nnx.Module, model: nnx.Module) -> nnx.Module:
  """Fills `model` (an abstract FP8 model, `nnx.eval_shape`) from `master` (the same model
  unquantised): each FP8 weight is its master quantised to 128 x 128 blocks (`quantize_weight`,
  per expert for stacked ones); every other array is the master's own, shared, not copied."""
  src = dict(nnx.to_flat_state(nnx.state(master)))
  dst = dict(nnx.to_flat_state(nnx.state(model)))
  fmt = model.opts.quant.fmt
  one = jax.jit(lambda w: quantize_weight(w, fmt))
  stacked = jax.jit(jax.vmap(lambda w: quantize_weight(w, fmt)))
  for path, var in dst.items():
    if path[-1] == "weight_scale_inv":
      continue
    w = src[path].get_value()
    if jnp.dtype(var.get_value().dtype).itemsize == 1:
      q, s = (stacked if w.ndim == 3 else one)(w)
      var.set_value(q)
      dst[path[:-1] + ("weight_scale_inv",)].set_value(s)
    else:
      var.set_value(w if w.dtype == var.get_value().dtype else w.astype(var.get_value().dtype))
  return model


def _rebind(model: nnx.Module, maker: Callable[[], nnx.Module]) -> nnx.Module:
  """The module `maker` builds (another fused setting), holding `model`'s arrays."""
  graphdef, _ = nnx.split(nnx.eval_shape(maker))
  return nnx.merge(graphdef, nnx.state(model))


def build(preset: str | None = None, checkpoint: str | None = None, *, fp8: bool = True,
          fused: bool = True, tp: int = 1, dtype=jnp.bfloat16, seed: int = 0,
          implementation: str | Sequence[str] | None = None, master: bool = True) -> Built:
  """A model from a preset (bf16 masters from `seed`, FP8 = those quantised) or a Hugging Face
  checkpoint, built for `tp` tensor-parallel devices (mesh axis "tp"); `implementation` is
  passed to every op the model runs (None: each op's best). `Built.make(fused, fp8=fp8,
  implementation=implementation)` gives the other paths over the same weights.
  `master=False` (a preset, FP8 paths only): the FP8 weights drawn directly from `seed`, no
  bf16 masters held (deepseek-v3-moe's FP8 weights fit an 80 GB GPU, its masters beside them
  do not); their values differ from the quantised masters'."""
  if not checkpoint and preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
  if not master and not fp8 and not checkpoint:
    raise ValueError("build(master=False) builds FP8 weights only; a bf16 path needs the masters")
  kw = dict(dtype=dtype, tp_axis="tp" if tp > 1 else None)
  if checkpoint:
    # Onto the mesh the run uses: each process reads only its devices' slices.
    mesh = tp_mesh(tp) if tp > 1 else None
    new = lambda fp8, fused, impl: registry.from_pretrained(
        checkpoint, fp8=fp8, fused=fused, implementation=impl, mesh=mesh, **kw)
    masters = None
  else:
    new = lambda fp8, fused, impl: registry.build(PRESETS[preset], seed=seed, fp8=fp8,
                                                  fused=fused, implementation=impl, **kw)
    masters = new(False, False, implementation) if master else None
  made: dict[bool, nnx.Module] = {}  # fp8 -> the first model built with those weights

  def make(fused: bool, fp8: bool = fp8, implementation=implementation) -> nnx.Module:
    if not fp8 and masters is None and not checkpoint:
      raise ValueError("this build holds no bf16 masters (master=False): no bf16 path")
    if fp8 in made:
      return _rebind(made[fp8], lambda: new(fp8, fused, implementation))
    if not fp8 and masters is not None:
      made[fp8] = masters
    elif fp8 and masters is not None:
      made[fp8] = quantize(masters, nnx.eval_shape(lambda: new(True, fused, implementation)))
    else:
      made[fp8] = new(fp8, fused, implementation)
    return made[fp8]

  return Built(make(fused), make, masters)


def tp_mesh(tp: int) -> jax.sharding.Mesh:
  """The mesh a run on `tp` devices uses: the first `tp` devices of one process; over several
  processes (jax.distributed), every device, as each process runs the program and must hold
  devices of it: `tp` consecutive devices of a process form a TP group (within a host where
  `tp` divides its devices), the groups replicas on a "dp" axis."""
  if jax.process_count() == 1:
    return jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
  if jax.device_count() % tp:
    raise InputError(f"--tp {tp} does not divide the {jax.device_count()} devices of the "
                     f"{jax.process_count()} processes")
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices).reshape(-1, tp), ("dp", "tp"))


def forward_fn(model: nnx.Module, tp: int):
  """`(forward(params, tokens, cache, pos) -> (logits, cache), params)` for `model` on `tp`
  devices. The weights are an argument, never a closure: a jit would capture closed-over
  arrays as constants of the program (gigabytes for the `-layers` presets, and a compile that
  never ends). `params` is the model state as a flat list of arrays, unflattened inside the
  jit: an nnx.State argument is flattened by Python at every call (110-210 us a call for the
  tiny presets against 37-52 us for the list, on this CPU), which a decode step pays on the
  host each time it is launched."""
  if tp > 1:
    apply, state = tp_apply(model, tp_mesh(tp), with_cache=True, explicit_params=True)
  else:
    graphdef, state = nnx.split(model)
    apply = lambda params, tokens, cache, pos: nnx.merge(graphdef, params)(
        tokens, cache=cache, pos=pos)
  flat, tree = jax.tree.flatten(state)

  def forward(params, tokens, cache, pos):
    return apply(jax.tree.unflatten(tree, params), tokens, cache, pos)

  return forward, flat


CHUNK = 8  # most decode steps one call runs (`chunk_for`)


def chunk_for(steps: int) -> int:
  """Steps per decode call for a round of `steps`: the largest divisor of `steps` up to CHUNK.

  The host's cost to launch a call is mostly per call, not per step: on the H200 a call of one
  deepseek-v3-deep step (FP8 fused, batch 1) took the host 1.57 ms to launch against 6.06 ms of
  kernels, a call of 8 steps 0.32 ms a step, one run each. The price is latency: a call's
  tokens arrive together."""
  return max(d for d in range(1, min(steps, CHUNK) + 1) if steps % d == 0)


def step_fns(forward):
  """Jitted `prefill(params, tokens, cache) -> (logits, next [B, 1], cache)` and
  `decode(params, toks [B, K], cache, pos) -> (toks [B, K], cache, pos + K)`: K greedy steps in
  one call (a `fori_loop`), from the token in the last column of `toks`, each step's token
  written to its column; tokens picked and the position carried on the device.

  The decode call donates its tokens and position as well as the cache, so its outputs take
  its inputs' buffers and no argument moves from call to call (XLA re-records a CUDA graph
  whenever a buffer it uses has moved): on the H200 the host's time to launch a step of
  deepseek-v3-deep fell from 3.0 / 2.1 ms to 1.4 / 1.5 ms (FP8 unfused / fused; bf16's stayed
  2.1), one run each."""
  def prefill(params, tokens, cache):
    logits, cache = forward(params, tokens, cache, 0)
    return logits, jnp.argmax(logits[:, -1:], -1).astype(tokens.dtype), cache

  def decode(params, toks, cache, pos):
    k = toks.shape[1]

    def step(i, carry):
      toks, cache, pos = carry
      tok = jax.lax.dynamic_slice_in_dim(toks, (i + k - 1) % k, 1, axis=1)  # the last token
      logits, cache = forward(params, tok, cache, pos)
      tok = jnp.argmax(logits[:, -1:], -1).astype(toks.dtype)
      return jax.lax.dynamic_update_slice_in_dim(toks, tok, i, axis=1), cache, pos + 1

    return jax.lax.fori_loop(0, k, step, (toks, cache, pos))

  return jax.jit(prefill, donate_argnums=2), jax.jit(decode, donate_argnums=(1, 2, 3))


def new_cache(model: nnx.Module, batch: int, length: int):
  """`model.init_cache(batch, length)` with every array its own buffer: a donated argument
  must not hold one buffer twice, and init_cache may hand out one zeros array for several
  layers."""
  return jax.tree.map(jnp.copy, model.init_cache(batch, length))


def profile(fn: Callable[[], object]):
  """`fn()` run and waited for under the profiler: its trace (`jax.profiler.ProfileData`), or
  None where none was written. The one reader of profiler traces, for this job and the
  benchmarks (`benchmarks/_harness.measure`)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    jax.block_until_ready(fn())
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    return jax.profiler.ProfileData.from_file(files[0]) if files else None


def gpu_kernels(data) -> list[list[tuple[int, int, str]]]:
  """The kernels of a trace (`profile`), per GPU that ran any: (start_ns, end_ns, name) of each
  event on its Stream lines. A CPU trace has none."""
  out = []
  for plane in data.planes if data else ():
    if plane.name.startswith("/device:GPU"):
      spans = [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for line in plane.lines
               if line.name.startswith("Stream") for ev in line.events]
      if spans:
        out.append(spans)
  return out


def device_seconds(fn: Callable[[], object]) -> float | None:
  """GPU kernel seconds of `fn()` from a profiler trace (summed over streams, averaged over the
  GPUs that ran something), or None where the trace has no GPU (CPU)."""
  return kernel_profile(fn)[0]


def kernel_profile(fn: Callable[[], object], top: int = 12) -> tuple[float | None, dict]:
  """`device_seconds(fn)` and the `top` kernels taking the most of it (`top_kernels`; {} on
  CPU)."""
  gpus = gpu_kernels(profile(fn))
  if not gpus:
    return None, {}
  total_ns = sum(end - start for spans in gpus for start, end, _ in spans)
  return total_ns * 1e-9 / len(gpus), top_kernels(gpus, top=top)


def top_kernels(per_gpu: list[list[tuple[int, int, str]]], calls: int = 1,
                top: int = 12) -> dict[str, float]:
  """The `top` kernels taking the most time in `gpu_kernels`' spans, {name (its first 80
  characters): us per call and GPU}."""
  by_name: dict[str, float] = {}
  for spans in per_gpu:
    for start, end, name in spans:
      by_name[name] = by_name.get(name, 0.0) + end - start
  most = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
  return {k[:80]: round(v * 1e-3 / calls / len(per_gpu), 3) for k, v in most}


def wall(fn, *args, reps: int = 7) -> float:
  """Median wall seconds of fn(*args) after a warm-up, synchronised."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def chain_seconds(f, sets: list, n: int) -> float:
  """Seconds per call by the slope of wall time between the jit `f` over `sets[:n]` and over
  all 2n `sets`: the fixed cost of dispatching a jit cancels, launch gaps count."""
  t1 = wall(f, sets[:n])
  t2 = wall(f, sets)
  return max(t2 - t1, 1e-9) / n


def call_seconds(op: Callable, make: Callable[[int], list], n: int) -> float:
  """Device seconds per call of `op` run on `n` distinct input sets (`make(count)`: count of
  them) in one jit, every output returned: the profiler's kernel time where a GPU ran it, else
  `chain_seconds` (which warms the jit up either way). The timing of `benchmarks/_harness.
  measure`, reduced to one figure."""
  sets = make(2 * n)
  f = jax.jit(lambda sets: [op(*s) for s in sets])
  chain = chain_seconds(f, sets, n)
  kernel = device_seconds(lambda: f(sets[:n]))
  return chain if kernel is None else kernel / n


def copy_seconds(nbytes: int, calls: int = 5) -> float:
  """Device time of a copy moving `nbytes` (half read, half written): an elementwise `a * 2`
  in f32, `calls` a timed jit. A small kernel pays a fixed launch and tail cost that the
  2 GiB copy of `copy_tbps` hides: this is the yardstick a kernel of that size can be held
  to."""
  n = max(1, nbytes // 8)

  def make(count):
    return [(jnp.full((n,), i + 1.5, jnp.float32),) for i in range(count)]

  return call_seconds(lambda a: a * 2.0, make, calls)


def copy_tbps(gib: float = 2.0) -> float:
  """Device copy bandwidth (bytes read + written per second), in TB/s: `copy_seconds` over
  `gib` GiB of f32, 3 calls a jit."""
  nbytes = 2 * (int(gib * 2**30) // 4) * 4
  return nbytes / copy_seconds(nbytes, calls=3) / 1e12


def bf16_tflops(n: int = 8192) -> float:
  """XLA's bf16 dot of two n x n matrices, in TFLOP/s (`call_seconds`, 3 calls a jit)."""
  def make(count):
    keys = jax.random.split(jax.random.key(0), 2 * count)
    return [(jax.random.normal(keys[2 * i], (n, n), jnp.bfloat16),
             jax.random.normal(keys[2 * i + 1], (n, n), jnp.bfloat16)) for i in range(count)]

  return 2 * n**3 / call_seconds(lambda a, b: a @ b, make, 3) / 1e12


def peaks() -> dict:
  """The device's peaks the roofline fractions are held to (`models.cost`), measured:
  `copy_tbps`, `bf16_tflops` and the FP8 peak taken from it."""
  bf16 = round(bf16_tflops(), 1)
  return dict(copy_tbps=round(copy_tbps(), 3), bf16_tflops=bf16,
              fp8_tflops=round(cost.FP8_PER_BF16 * bf16, 1))


def run_path(name: str, forward, params, tokens, empty: Callable[[], object], steps: int,
             repeats: int, progress=None) -> dict:
  """Compile, prefill `tokens [B, T]` into `empty()` (a new cache; the numerics'
  teacher-forced logits), then `repeats` timed rounds of `steps` greedy decode steps after a
  warm-up round (module docstring)."""
  progress = progress or Quiet()
  prefill, decode = step_fns(forward)
  b, t = tokens.shape
  pos0 = jnp.int32(t)
  gpu = jax.devices()[0].platform == "gpu"
  cache = empty()
  t0 = time.perf_counter()
  with progress.spin(f"compile {name} prefill"):
    prefill_c = prefill.lower(params, tokens, cache).compile()
  compile_s = time.perf_counter() - t0
  logits, tok0, cache = jax.block_until_ready(prefill_c(params, tokens, cache))
  logits = np.asarray(logits, np.float32)
  spare = jax.block_until_ready(empty())
  t0 = time.perf_counter()
  jax.block_until_ready(prefill_c(params, tokens, spare))
  prefill_s = time.perf_counter() - t0
  spare = jax.block_until_ready(empty())  # made outside the trace: its copies are no prefill's
  prefill_dev = device_seconds(lambda: prefill_c(params, tokens, spare)) if gpu else None
  del spare
  t0 = time.perf_counter()
  with progress.spin(f"compile {name} decode"):
    # for the cache as the prefill lays it out (under TP: split over the devices)
    decode_c = decode.lower(params, first_toks(tok0, steps), cache, pos0).compile()
  compile_s += time.perf_counter() - t0
  progress.say(f"compiled {name} prefill + decode in {compile_s:.1f} s; prefill "
               f"{prefill_s * 1e3:.1f} ms")
  counts = kernel_counts(decode_c.as_text())

  round_ = lambda cache: decode_round(decode_c, params, tok0, cache, pos0, steps)
  *_, cache = round_(cache)  # warm-up
  step_s, enqueue_s = [], []
  with progress.bar(f"decode {name}", repeats) as advance:
    for _ in range(repeats):
      s, e, last, cache = round_(cache)
      step_s.append(s)
      enqueue_s.append(e)
      advance()
  holder = [cache]

  def traced():
    *_, holder[0] = round_(holder[0])
    return holder[0]

  dev = device_seconds(traced) if gpu else None
  p10, med, p90 = np.percentile(step_s, [10, 50, 90])
  return dict(compile_s=compile_s, prefill_ms=prefill_s * 1e3,
              prefill_device_ms=prefill_dev and prefill_dev * 1e3,
              prefill_tokens_per_s=b * t / prefill_s, step_ms=med * 1e3,
              step_ms_p10=p10 * 1e3, step_ms_p90=p90 * 1e3,
              enqueue_ms=float(np.median(enqueue_s)) * 1e3,
              device_ms=dev and dev / steps * 1e3, tokens_per_s=b / med, kernels=counts,
              logits=logits, last_tokens=np.asarray(last[:, -1:]))


def rooflines(model: nnx.Module, x: dict, peaks: dict | None, batch: int, prompt_len: int,
              cache) -> dict:
  """A path's fractions of its floors at `peaks` (`models.cost`), from its figures `x`
  (`run_path`'s): `prefill_roofline_frac`, the prefill's FLOPs (logits at every position, as
  `step_fns`' prefill computes them) over its kernel time, and `roofline_frac`, the bytes a
  decode step reads (the weights it touches and `cache`, every slot) over its kernel time. Each
  None without peaks or without that kernel time."""
  pre = dec = None
  if peaks and x["prefill_device_ms"]:
    proj, attn = cost.prefill_flops(model, batch, prompt_len, logits="all")
    floor = cost.prefill_floor(proj, attn, peaks["bf16_tflops"])
    pre = floor / (x["prefill_device_ms"] * 1e-3)
  if peaks and x["device_ms"]:
    read = cost.weight_bytes(model, batch) + cost.cache_bytes(cache)
    dec = cost.step_floor(read, peaks["copy_tbps"]) / (x["device_ms"] * 1e-3)
  return dict(prefill_roofline_frac=pre, roofline_frac=dec)


def first_toks(tok: jax.Array, steps: int) -> jax.Array:
  """The `toks [B, K]` a round of `steps` starts from (`step_fns`' decode; K = `chunk_for`):
  `tok [B, 1]` in every column, the last one being what the first step reads."""
  return jnp.repeat(tok, chunk_for(steps), axis=1)


def decode_round(decode, params, tok0, cache, pos0, steps: int):
  """`steps` greedy decode steps from token `tok0 [B, 1]` at `pos0`, in calls of `chunk_for`
  steps launched back to back with one sync at the end, as a serving loop runs them: (wall
  seconds per step, the host's seconds per step to launch them, the last call's tokens
  [B, K], the cache). `decode`: `step_fns`' decode, compiled for `first_toks(tok0, steps)`."""
  toks, pos = first_toks(tok0, steps), jnp.copy(pos0)
  calls = steps // toks.shape[1]
  jax.block_until_ready((toks, pos))
  t0 = time.perf_counter()
  for _ in range(calls):
    toks, cache, pos = decode(params, toks, cache, pos)
  t1 = time.perf_counter()
  jax.block_until_ready((toks, cache))
  return (time.perf_counter() - t0) / steps, (t1 - t0) / steps, toks, cache


class Quiet:
  """The progress reporter `run` takes, silent: `say(line)`, `spin(label)` around a phase of
  unknown length, `bar(label, total)` yielding `advance()`."""

  def say(self, msg: str) -> None:
    pass

  @contextlib.contextmanager
  def spin(self, label: str):
    yield

  @contextlib.contextmanager
  def bar(self, label: str, total: int):
    yield lambda: None


def agreement(ref: np.ndarray, got: np.ndarray) -> dict:
  """Top-1 agreement and KL(ref || got) (nats, mean per position) of two logit sets
  `[..., V]`."""
  top1 = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
  lr = ref - ref.max(-1, keepdims=True)
  lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
  lg = got - got.max(-1, keepdims=True)
  lg = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
  kl = float(np.mean(np.sum(np.exp(lr) * (lr - lg), -1)))
  return dict(top1=top1, kl=kl, max_abs_diff=float(np.abs(ref - got).max()))


def prompt(vocab: int, batch: int, prompt_len: int, seed: int) -> jax.Array:
  """The fixed random prompt `[batch, prompt_len]` of a run with `seed`."""
  return jax.random.randint(jax.random.key(seed + 1), (batch, prompt_len), 0, vocab, jnp.int32)


def run(preset=None, checkpoint=None, *, batch=RANGE_BATCH, prompt_len=RANGE_PROMPT, steps=32,
        repeats=20, tp=1, paths: Sequence[str] = PATHS, seed=0, progress=None) -> dict:
  """Every path of `paths` on one set of weights (module docstring); `progress`: a `Quiet`
  (the default) or the CLI's reporter."""
  progress = progress or Quiet()
  measured = None
  if tp == 1 and jax.devices()[0].platform == "gpu":
    # Before the build: the 2 GiB copies and their outputs take 24 GiB of the device.
    with progress.spin("measure the device's copy bandwidth and bf16 dot"):
      measured = peaks()
    progress.say(f"copy {measured['copy_tbps']:.2f} TB/s, bf16 dot "
                 f"{measured['bf16_tflops']:.0f} TFLOP/s")
  t0 = time.perf_counter()
  with progress.spin("build"):
    built = build(preset, checkpoint, fp8="bf16" not in paths, tp=tp, seed=seed,
                  master="bf16" in paths)
    models = {p: built.path(p) for p in paths}
  progress.say(f"built {preset or checkpoint} ({built.layers} layers) in "
               f"{time.perf_counter() - t0:.1f} s")
  cfg = next(iter(models.values())).cfg
  tokens = prompt(cfg.vocab_size, batch, prompt_len, seed)
  result = dict(model=preset or checkpoint, seed=seed, platform=jax.devices()[0].platform,
                device=jax.devices()[0].device_kind, jax=jax.__version__,
                commit=checkout_commit(), date=datetime.date.today().isoformat(), tp=tp,
                batch=batch, prompt_len=prompt_len, steps=steps, steps_per_call=chunk_for(steps),
                repeats=repeats, layers=built.layers, peaks=measured, paths={})
  fp8_params = None  # the fused and unfused paths share one placed copy of the FP8 weights
  for name, model in models.items():
    forward, params = forward_fn(model, tp)
    if name != "bf16":
      fp8_params = params = fp8_params or params
    empty = lambda model=model: new_cache(model, batch, prompt_len + steps)
    progress.say(f"{name}: prefill {batch} x {prompt_len} tokens, then {repeats} rounds of {steps} "
        f"decode steps")
    x = run_path(name, forward, params, tokens, empty, steps, repeats, progress)
    x.update(rooflines(model, x, measured, batch, prompt_len, jax.eval_shape(empty)))
    result["paths"][name] = x
    del forward, params
  if tp > 1:
    from jfusedq import parallel
    h = cfg.hidden_size
    spec = jax.ShapeDtypeStruct((batch, 1, h), jnp.bfloat16)
    result["allreduce_strategy"] = parallel.chosen_strategy(
        spec, jax.ShapeDtypeStruct((h,), jnp.bfloat16), residual=spec,
        fmt=default_format(), keep_bf16=True)
  runs = result["paths"]
  result["fp8_cost"] = (fp8_cost(default_format().name) if set(runs) - {"bf16"} else None)
  ranged = not checkpoint and at_range_size(batch, prompt_len)
  result["numerics"] = {f"{a} -> {b}": dict(agreement(runs[a]["logits"], runs[b]["logits"]),
                                            expected=expected_range(preset, (a, b)) if ranged
                                            else None)
                        for a, b in PAIRS if a in runs and b in runs}
  result["ratios"] = {}
  for num, den in (("fused", "bf16"), ("unfused", "bf16"), ("fused", "unfused")):
    if num in runs and den in runs:
      n, d = runs[num], runs[den]
      result["ratios"][f"{num}/{den}"] = dict(
          ratio=n["step_ms"] / d["step_ms"],
          within_noise=bool(n["step_ms_p10"] <= d["step_ms_p90"]
                            and d["step_ms_p10"] <= n["step_ms_p90"]))
  if "fused" in runs and "unfused" in runs:
    saved = runs["unfused"]["kernels"]["total"] - runs["fused"]["kernels"]["total"]
    result["kernels_saved_per_step"] = saved
    result["kernels_saved_per_layer"] = saved / built.layers
  return result


def _range(v: float, lo: float, hi: float, fmt: str) -> str:
  inside = "" if lo <= v <= hi else ", OUTSIDE"
  return f"expected {format(lo, fmt)}-{format(hi, fmt)}{inside}"


def direction(key: str, ratio: float) -> str:
  """A step-time ratio "num/den" in words: which path is faster, by how much."""
  num, den = key.split("/")
  if round(ratio, 3) == 1:
    return f"{num} as fast as {den}"
  if ratio > 1:
    return f"{num} {ratio:.2f}x slower than {den}"
  return f"{num} {1 / ratio:.2f}x faster than {den}"


# The tables' columns: the JSON keys of a path's figures (`to_json`), kernels by kind.
PREFILL_COLUMNS = (("compile_s", 9), ("prefill_ms", 10), ("prefill_device_ms", 17),
                   ("prefill_tokens_per_s", 20), ("prefill_roofline_frac", 21))
DECODE_COLUMNS = (("step_ms", 8), ("step_ms_p10-p90", 15), ("enqueue_ms", 10), ("device_ms", 9),
                  ("tokens_per_s", 12), ("roofline_frac", 13), ("kernels", 7), ("fusion", 6),
                  ("custom-call", 11), ("collective", 10), ("other", 5))


def _cell(v, spec: str) -> str:
  """A figure as the tables print it: "-" where it is null (not measured)."""
  return "-" if v is None else format(v, spec)


def _rows(r: dict, columns, cells) -> list[str]:
  """A table of every path: a header of `columns` (name, width), a row of `cells(figures)`."""
  head = f"{'path':>8} " + " ".join(f"{name:>{w}}" for name, w in columns)
  lines = [head, "-" * len(head)]
  for name, x in r["paths"].items():
    lines.append(f"{name:>8} " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells(x), columns)))
  return lines


def table(r: dict) -> str:
  lines = [f"{r['model']} on {r['platform']} ({r['device']}), tp={r['tp']}, batch {r['batch']},"
           f" prompt {r['prompt_len']}, {r['layers']} layers; decode: {r['repeats']} rounds of"
           f" {r['steps']} steps ({r['steps_per_call']} a call) after a warm-up round"]
  cpu = r["platform"] == "cpu"
  if cpu:
    lines.append("CPU: these are XLA:CPU wall times of a host-bound program, NOT kernel speeds "
                 "(kernel times come from a GPU run)")
  peaks = r["peaks"]
  if peaks:
    lines.append(f"roofline peaks, measured on this device: copy {peaks['copy_tbps']:.2f} TB/s, "
                 f"XLA bf16 dot {peaks['bf16_tflops']:.0f} TFLOP/s, FP8 taken as "
                 f"{peaks['fp8_tflops']:.0f}")
  elif r["tp"] > 1:
    lines.append("no roofline fractions under --tp: the weights' split over the devices is not "
                 "counted")
  else:
    lines.append(f"no roofline fractions on {r['platform']}: peaks and kernel times come from a "
                 f"GPU run")
  lines.append("prefill per path (the JSON keys; one call after the first; "
               "prefill_roofline_frac: FLOP floor / kernel time):")
  lines += _rows(r, PREFILL_COLUMNS, lambda x: (
      f"{x['compile_s']:.2f}", f"{x['prefill_ms']:.2f}", _cell(x["prefill_device_ms"], ".3f"),
      f"{x['prefill_tokens_per_s']:.1f}", _cell(x["prefill_roofline_frac"], ".3f")))
  lines.append("decode per path (ms are per step, kernels those one step launches; "
               "roofline_frac: byte floor / kernel time):")
  lines += _rows(r, DECODE_COLUMNS, lambda x: (
      f"{x['step_ms']:.3f}", f"{x['step_ms_p10']:.3f}-{x['step_ms_p90']:.3f}",
      f"{x['enqueue_ms']:.3f}", _cell(x["device_ms"], ".3f"), f"{x['tokens_per_s']:.1f}",
      _cell(x["roofline_frac"], ".3f"), *(x["kernels"][k] for k in (
          "total", "fusion", "custom-call", "collective", "other"))))
  for name, x in r["paths"].items():
    if x["device_ms"]:
      wall, host = x["step_ms"] / x["device_ms"], x["enqueue_ms"] / x["device_ms"]
      pace = "the host" if host >= 1 else "the GPU"
      lines.append(f"{name}: a step's wall time is {wall:.2f}x its kernel time; enqueueing it "
                   f"takes the host {host:.2f}x the kernel time ({pace} sets the pace)")
  for key, v in r["ratios"].items():
    noise = " (within noise: the p10-p90 spreads overlap)" if v["within_noise"] else ""
    lines.append(f"step time {key}: {v['ratio']:.3f}x, {direction(key, v['ratio'])}{noise}")
  if cpu and any(k.endswith("/bf16") for k in r["ratios"]):
    lines += ["  why, on CPU: no FP8 units, so the FP8 paths run the XLA reference ops, which "
              "widen every", "  FP8 weight to f32 and multiply in f32 each step; FP8's gain, "
              "half the weight bytes read, needs a GPU"]
  if "kernels_saved_per_step" in r:
    p = r["paths"]
    lines.append(f"kernels a decode step: unfused {p['unfused']['kernels']['total']}, fused "
                 f"{p['fused']['kernels']['total']}: the fused path launches "
                 f"{r['kernels_saved_per_step']} fewer, {r['kernels_saved_per_layer']:.2f} a "
                 f"layer on average over its {r['layers']} layers")
    if cpu:
      lines.append("  counted in XLA:CPU's program, whose fusions are not a GPU's (on the H200 "
                   "the fused path saves 2-4 a layer: benchmarks/README.md)")
  cost = r.get("fp8_cost")
  if cost:
    c = cost["case"]
    paths = ", ".join(f"{p} {cost[p]['nll_delta']:+.3f} +- {cost[p]['se']:.3f}"
                      for p in ("unfused", "fused") if p in cost)
    lines.append("what FP8 costs on a trained model (a stored result, not this run's model: the "
                 "same for every --model):")
    lines.append(f"  benchmarks/accuracy.py at {cost['commit']} on {cost['device']}, "
                 f"{cost['date']} (benchmarks/results/accuracy.json)")
    lines.append(f"  model {c['model']}; {c['tokens']} tokens of {c['text']}")
    lines.append(f"  next-token NLL bf16 {cost['bf16_nll']:.3f} nats; FP8 - bf16 {paths} (+- the "
                 f"standard error)")
  if r["numerics"]:
    n = r["batch"] * r["prompt_len"]
    what = ("random weights: a check against the measured range, not an accuracy figure"
            if r["model"] in EXPECTED else "reference -> path")
    if r["model"] in EXPECTED and not at_range_size(r["batch"], r["prompt_len"]):
      what += f"; ranges measured at batch {RANGE_BATCH} x prompt {RANGE_PROMPT} only"
    lines.append(f"numerics, teacher-forced over {n} positions of one fixed token sequence "
                 f"({what}):")
  for key, a in r["numerics"].items():
    e = a["expected"]
    kl_e = (f" ({_range(a['kl'], e['kl_low'], e['kl_high'], '.2e')})" if e
            else " (no measured range)")
    top_e = f" ({_range(a['top1'], e['top1_low'], e['top1_high'], '.3f')})" if e else ""
    lines.append(f"  {key:>16}: KL {a['kl']:.2e} nats{kl_e}, top-1 {a['top1']:.3f}{top_e}")
  if "allreduce_strategy" in r:
    lines.append(f"all-reduce strategy at prepare_attn: {r['allreduce_strategy']}")
  return "\n".join(lines)


def to_json(r: dict) -> dict:
  """`r` without the raw logits and tokens."""
  out = dict(r, paths={k: {kk: vv for kk, vv in v.items() if kk not in ("logits", "last_tokens")}
                       for k, v in r["paths"].items()})
  return out
