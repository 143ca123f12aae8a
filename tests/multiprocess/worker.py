"""One process of a multi-process run, or the whole run in one process: the models' prefill +
decode step under tensor parallelism, every all-reduce strategy, and a checkpoint loaded for
tensor parallelism, on a global 8-device mesh.

  python -m tests.multiprocess.worker OUT [--coordinator H:P --num-processes N --process-id I]

Every process builds the same inputs from the same seeds; process 0 writes the results (global
arrays, gathered) to OUT as a pickle of numpy arrays. The meshes interleave the processes'
devices, so every tensor-parallel group spans both processes and each collective crosses them;
one process of 8 devices builds the same meshes from two groups of 4.
"""

from __future__ import annotations

import argparse
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
  greedy token."""
  from models import registry
  from models.common import tp_apply
  from models.presets import PRESETS

  m = mesh((4, 2), ("dp", "tp"))
  for name, cut in MODELS.items():
    model = registry.build(dict(PRESETS[name], **cut), seed=0, fp8=True, fused=True,
                           tp_axis="tp")
    step = tp_apply(model, m, with_cache=True)
    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (BATCH, PROMPT),
                                               dtype=np.int32)
    logits, cache = step(tokens, model.init_cache(BATCH, PROMPT + 1))
    nxt = np.asarray(gather(jnp.argmax(logits[:, -1], -1))).astype(np.int32)[:, None]
    logits2, _ = step(nxt, cache, PROMPT)
    out[f"{name}/prefill"] = gather(logits)
    out[f"{name}/decode"] = gather(logits2)


def allreduce(out: dict) -> None:
  """Every strategy, and sequence parallelism, on 8 random bf16 partial sums over an 8-device
  "tp" axis."""
  from jfusedq.parallel import STRATEGIES, allreduce_rmsnorm_quant_sharded

  m = mesh((8,), ("tp",))
  rng = np.random.default_rng(2)
  xs = rng.standard_normal((8, TOKENS, HIDDEN), np.float32).astype(jnp.bfloat16)
  res = rng.standard_normal((TOKENS, HIDDEN), np.float32).astype(jnp.bfloat16)
  w = (1 + 0.1 * rng.standard_normal(HIDDEN, np.float32)).astype(jnp.bfloat16)
  for sp in (False, True):
    args = [place(a, NamedSharding(m, spec))
            for a, spec in ((xs, P("tp")), (res, P("tp") if sp else P()), (w, P()))]
    for s in STRATEGIES:
      f = jax.jit(lambda x, r, w, s=s, sp=sp: allreduce_rmsnorm_quant_sharded(
          x, r, w, mesh=m, axis_name="tp", sequence_parallel=sp, strategy=s))
      quant, res_out = f(*args)
      key = f"{'reduce_scatter' if sp else 'allreduce'}/{s}"
      out[key + "/q"], out[key + "/scale"], out[key + "/residual"] = gather(
          (quant.q, quant.scale, res_out))


def checkpoint(out: dict, where: str) -> None:
  """A Llama f32 safetensors checkpoint (written by process 0), loaded by every process as FP8
  (quantised on load) with TP 8; the safetensors bytes each process reads are counted."""
  from jfusedq.checkpoint import SafetensorsFile
  from models import registry
  from models.common import tp_apply
  from tests.models.test_llama import F32, TP, build, save_checkpoint

  if distributed.is_main():
    save_checkpoint(build(TP, **F32), where)
  multihost_utils.sync_global_devices("checkpoint written")
  # Bytes of the tensors the loader takes from the reader (each a memory-mapped view, read
  # whole by the loader); membership tests, which Mapping answers through __getitem__, are not
  # reads.
  read = [0]
  get, has = SafetensorsFile.__getitem__, SafetensorsFile.__contains__

  def counted(self, name):
    a = get(self, name)
    read[0] += a.nbytes
    return a

  SafetensorsFile.__getitem__ = counted
  SafetensorsFile.__contains__ = lambda self, name: name in self._entries
  try:
    model = registry.from_pretrained(where, fp8=True, tp_axis="tp")
  finally:
    SafetensorsFile.__getitem__, SafetensorsFile.__contains__ = get, has
  tokens = np.random.default_rng(3).integers(0, TP.vocab_size, (BATCH, PROMPT), dtype=np.int32)
  out["llama/prefill"] = gather(tp_apply(model, mesh((8,), ("tp",)))(tokens).logits)
  f = SafetensorsFile(os.path.join(where, "model.safetensors"))
  size = sum(f[k].nbytes for k in f)  # memory-mapped views: nothing is read
  print(f"process {jax.process_index()}: read {read[0]} of the checkpoint's {size} tensor bytes")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  distributed.add_arguments(ap)
  args = ap.parse_args(argv)
  distributed.initialize(args)
  if jax.device_count() != 8:
    raise SystemExit(f"needs 8 devices in all, got {jax.device_count()}")
  out: dict = {}
  for name, part in (("all-reduce", allreduce), ("models", models),
                     ("checkpoint", lambda out: checkpoint(out, args.out + ".ckpt"))):
    t0 = time.perf_counter()
    part(out)
    print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  if distributed.is_main():
    with open(args.out, "wb") as f:
      pickle.dump(out, f)
  print(f"process {jax.process_index()} of {jax.process_count()}: {len(out)} results")
  return 0


if __name__ == "__main__":
  sys.exit(main())
