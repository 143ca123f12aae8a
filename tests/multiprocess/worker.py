"""One process of a multi-process run, or the whole run in one process: the models' prefill +
decode step under tensor parallelism, every all-reduce strategy, a checkpoint loaded onto the
mesh (the bytes each process reads counted), and `jfusedq run`'s forward at TP 4
(models.run.forward_fn), on a global 8-device mesh.

  python -m tests.multiprocess.worker OUT [--cases C,..] [--coordinator H:P --num-processes N
                                                           --process-id I]

Every process builds the same inputs from the same seeds; process 0 writes OUT, a pickle of
{"results": global arrays gathered as numpy, and per case: "read" (bytes read per process),
"total" and "replicated" (the checkpoint's tensor bytes), "forward_fn" (logits or None)}. The meshes
interleave the processes' devices, so every tensor-parallel group spans both processes and
each collective crosses them; one process of 8 devices builds the same meshes from two groups
of 4. Each case is one compiled program (a model's prefill and decode step together, every
all-reduce strategy together): compiling is most of the run's CPU time.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import distributed
from models.common.sharding import place

GROUPS = 2  # processes of the multi-process run (devices are grouped so in one process too)
BATCH, PROMPT = 2, 8
TOKENS, HIDDEN = 16, 256  # all-reduce inputs: [TOKENS, HIDDEN] per device


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
  """Devices in the order (device i of group 0, device i of group 1, device i + 1 of group 0,
  ...), reshaped to `shape`: the last axis steps across groups first."""
  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  order = np.array(devs, dtype=object).reshape(GROUPS, -1).T.reshape(-1)
  return jax.sharding.Mesh(order.reshape(shape), names)


def gather(tree):
  """Global arrays as numpy, on every process."""
  return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
                      tree)


# The tiny presets cut to two layers, each layer kind once: DeepSeek-V3 dense + MoE, Qwen3.5
# GDN + attention.
MODELS = {"deepseek-v3-tiny": dict(num_hidden_layers=2, first_k_dense_replace=1),
          "qwen3.5-tiny": dict(num_hidden_layers=2, full_attention_interval=2)}


def models(out: dict) -> None:
  """Both models, FP8, fused, TP 2 over a (dp 4, tp 2) mesh (the tiny presets' FP8 weights
  split into whole 128 x 128 blocks over 2 devices only): prefill, then one decode step on the
  greedy token, in one program (one compile a model)."""
  from models import registry
  from models.common import tp_apply
  from models.presets import PRESETS

  m = mesh((4, 2), ("dp", "tp"))
  rep = NamedSharding(m, P())
  for name, cut in MODELS.items():
    model = registry.build(dict(PRESETS[name], **cut), seed=0, fp8=True, fused=True,
                           tp_axis="tp")
    apply, params = tp_apply(model, m, with_cache=True, explicit_params=True)

    @jax.jit
    def step(params, tokens, cache):
      logits, cache = apply(params, tokens, cache)
      nxt = jnp.argmax(logits[:, -1], -1).astype(tokens.dtype)[:, None]
      return logits, apply(params, nxt, cache, PROMPT).logits

    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (BATCH, PROMPT),
                                               dtype=np.int32)
    cache = jax.tree.map(lambda a, s: place(np.asarray(a), NamedSharding(m, s)),
                         model.init_cache(BATCH, PROMPT + 1), model.cache_specs())
    out[f"{name}/prefill"], out[f"{name}/decode"] = gather(
        step(params, place(tokens, rep), cache))


def allreduce(out: dict) -> None:
  """Every strategy, and sequence parallelism, on 8 random bf16 partial sums over an 8-device
  "tp" axis, in one program (one compile)."""
  from jfusedq.parallel import STRATEGIES, allreduce_rmsnorm_quant_sharded

  m = mesh((8,), ("tp",))
  rng = np.random.default_rng(2)
  xs = rng.standard_normal((8, TOKENS, HIDDEN), np.float32).astype(jnp.bfloat16)
  res = rng.standard_normal((TOKENS, HIDDEN), np.float32).astype(jnp.bfloat16)
  w = (1 + 0.1 * rng.standard_normal(HIDDEN, np.float32)).astype(jnp.bfloat16)
  args = [place(a, NamedSharding(m, spec))
          for a, spec in ((xs, P("tp")), (res, P()), (res, P("tp")), (w, P()))]

  @jax.jit
  def every(xs, res, res_sp, w):
    got = {}
    for sp in (False, True):
      for s in STRATEGIES:
        quant, res_out = allreduce_rmsnorm_quant_sharded(
            xs, res_sp if sp else res, w, mesh=m, axis_name="tp", sequence_parallel=sp,
            strategy=s)
        key = f"{'reduce_scatter' if sp else 'allreduce'}/{s}"
        got[key + "/q"], got[key + "/scale"], got[key + "/residual"] = (quant.q, quant.scale,
                                                                         res_out)
    return got

  out.update(gather(every(*args)))


def checkpoint(out: dict, meta: dict, where: str) -> None:
  """A Llama f32 safetensors checkpoint (written by process 0), loaded by every process as FP8
  (quantised on load) straight onto the TP 8 mesh; the tensor bytes each process reads are
  counted (every read goes through SafetensorsFile.read)."""
  from jfusedq.checkpoint import SafetensorsFile
  from models import registry
  from models.common import tp_apply
  from tests.models.test_llama import F32, TP, build, save_checkpoint

  if distributed.is_main():
    save_checkpoint(build(TP, **F32), where)
  multihost_utils.sync_global_devices("checkpoint written")
  read = [0]
  orig = SafetensorsFile.read

  def counted(self, name, index):
    a = orig(self, name, index)
    read[0] += a.nbytes
    return a

  m = mesh((8,), ("tp",))
  SafetensorsFile.read = counted
  try:
    model = registry.from_pretrained(where, fp8=True, tp_axis="tp", mesh=m)
  finally:
    SafetensorsFile.read = orig
  tokens = np.random.default_rng(3).integers(0, TP.vocab_size, (BATCH, PROMPT), dtype=np.int32)
  out["llama/prefill"] = gather(tp_apply(model, m)(tokens).logits)
  f = SafetensorsFile(os.path.join(where, "model.safetensors"))
  size = {k: math.prod(f.spec(k)[0]) * f.spec(k)[1].itemsize for k in f}
  meta["read"] = [int(r) for r in multihost_utils.process_allgather(np.int64(read[0]))]
  meta["total"] = sum(size.values())
  # Replicated: the embedding and the norms; every projection splits over the 8 devices.
  meta["replicated"] = sum(v for k, v in size.items() if not k.endswith("proj.weight"))
  print(f"process {jax.process_index()}: read {read[0]} of the checkpoint's {meta['total']} "
        f"tensor bytes")


def forward_fn(meta: dict) -> None:
  """models.run.forward_fn with tp 4 below the 8 devices, prefill as `jfusedq run` makes it:
  every process must hold devices of its mesh (the CLI fetches the logits on every process).
  Left out (meta["forward_fn"] None) where some process holds no shard of the parameters."""
  from models import run
  from tests.models.test_llama import TP, build

  model = build(TP, fp8=True, fused=True, tp_axis="tp")
  forward, params = run.forward_fn(model, 4)
  holds = multihost_utils.process_allgather(np.int32(all(p.addressable_shards for p in params)))
  if not np.all(holds):
    meta["forward_fn"] = None
    return
  tokens = np.random.default_rng(4).integers(0, TP.vocab_size, (BATCH, PROMPT), dtype=np.int32)
  prefill, _ = run.step_fns(forward)
  logits, _, _ = prefill(params, tokens, run.new_cache(model, BATCH, PROMPT))
  meta["forward_fn"] = np.asarray(logits)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--cases", default="all-reduce,models,checkpoint",
                  help="comma-separated, of: all-reduce, models, checkpoint, forward_fn")
  distributed.add_arguments(ap)
  args = ap.parse_args(argv)
  distributed.initialize(args)
  if jax.device_count() != 8:
    raise SystemExit(f"needs 8 devices in all, got {jax.device_count()}")
  out: dict = {}
  meta: dict = {}
  cases = {"all-reduce": lambda: allreduce(out), "models": lambda: models(out),
           "checkpoint": lambda: checkpoint(out, meta, args.out + ".ckpt"),
           "forward_fn": lambda: forward_fn(meta)}
  for name in args.cases.split(","):
    t0, c0 = time.perf_counter(), time.process_time()
    cases[name]()
    print(f"{name}: {time.perf_counter() - t0:.1f} s ({time.process_time() - c0:.1f} s of CPU)",
          file=sys.stderr)
  if distributed.is_main():
    with open(args.out, "wb") as f:
      pickle.dump(dict(results=out, **meta), f)
  print(f"process {jax.process_index()} of {jax.process_count()}: {len(out)} results")
  return 0


if __name__ == "__main__":
  sys.exit(main())
