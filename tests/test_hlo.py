"""Kernel counting from compiled HLO: the fused op is one kernel where XLA needs several."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from helpers import activations, rng, weights
from jfusedq import rmsnorm_quant
from jfusedq.hlo import count_kernels, kernel_counts
from jfusedq.testing import WIDTHS


def test_xla_path_counts_fusions():
  r = rng("hlo")
  h = WIDTHS["deepseek_v3.q_a_kv_a"]
  x, res, w = activations(r, (4, h)), activations(r, (4, h)), weights(r, h)
  c = count_kernels(lambda x, r, w: rmsnorm_quant(x, w, residual=r, implementation="xla"),
                    x, res, w)
  assert c["custom-call"] == 0 and c["collective"] == 0
  assert c["fusion"] >= 2 and c["total"] == sum(v for k, v in c.items() if k != "total")


def test_collectives_and_loops():
  mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jnp.asarray(rng("hlo-c").standard_normal((4, 8, 256)), jnp.float32)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp")))

  def step(x):
    y = jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=P("tp"),
                      out_specs=P())(x)
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 2.0, y)

  c = count_kernels(step, x)
  assert c["collective"] == 1
  assert c["fusion"] + c["other"] >= 1  # the loop body's work is counted once


def test_parses_tuple_shapes_and_rejects_garbage():
  text = """HloModule m
ENTRY %main (p: f32[2]) -> (f32[2], f32[2]) {
  %p = f32[2]{0} parameter(0)
  %cc = (f32[2]{0}, f32[2]{0}) custom-call(%p), custom_call_target="x"
  %a = f32[2]{0} get-tuple-element(%cc), index=0
  ROOT %t = (f32[2]{0}, f32[2]{0}) tuple(%a, %a)
}
"""
  assert kernel_counts(text) == {"fusion": 0, "custom-call": 1, "collective": 0, "other": 0,
                                 "total": 1}
  np.testing.assert_raises(ValueError, kernel_counts, "not hlo")
