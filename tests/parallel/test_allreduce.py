"""allreduce_rmsnorm_quant on 1, 2, 4 and 8 simulated CPU devices: every strategy against psum +
the XLA reference, replication, the strategy chain (opt-out, gates, declines), sequence-parallel
mode, errors, and lowering for CUDA / ROCm abstract meshes."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractDevice, AbstractMesh
from jax.sharding import PartitionSpec as P

from helpers import (FORMATS, SCALE_RTOL, TARGETS, TRITON_CALL, activations, assert_quant_close,
                     assert_rounded_close, rng, weights)
from jfusedq import Unsupported, group_quant, implementations, rmsnorm, rmsnorm_quant
from jfusedq.ops import _dispatch
from jfusedq.parallel import (DISABLE_ENV, STRATEGIES, allreduce, allreduce_rmsnorm_quant,
                              allreduce_rmsnorm_quant_sharded, chosen_strategy,
                              reduce_scatter_rmsnorm_quant)

S = jax.ShapeDtypeStruct
AXIS = "tp"

# ar_norm_then_quant quantises bf16(norm) instead of the f32 norm. The group amax is then
# rounded to bf16 (at most half a bf16 ulp, 2**-8 relative), so its scales may differ from the
# reference by up to 2**-8 (3.9e-3 measured at H = 576..7168); each y / scale moves by up to
# ~2**-7 relative against FP8 steps of 2**-4..2**-3, so a code moves by at most one step, and
# about 2% of them do (2.0-2.3% measured; aiter reports ~2% for the same rounding). 5% leaves
# room for small samples and still catches a real error.
AR_SCALE_RTOL = 2.0**-8 + SCALE_RTOL  # + the f32 slack of the two scale divisions
AR_CODE_FRAC = 0.05


@pytest.fixture(autouse=True)
def _fresh_log():
  # The choice is logged once per process; each test starts unlogged so it can observe it.
  _dispatch._logged.clear()


def mesh(n):
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))


def inputs(key, n, shape, residual=True, dtype=jnp.bfloat16):
  """N distinct partial sums `[n, *shape]`, a residual `shape` and a weight `[H]`."""
  r = rng(*key)
  xs = activations(r, (n, *shape), dtype)
  res = activations(r, shape, dtype) if residual else None
  return xs, res, weights(r, shape[-1])


def sharded(n, body, xs, res, w, out_specs=P(), res_spec=P(), check_vma=False):
  """jit(shard_map(body)) with device i holding xs[i]; outputs replicated by default."""
  f = jax.shard_map(lambda x, r, w: body(x[0], r, w), mesh=mesh(n),
                    in_specs=(P(AXIS), res_spec, P()), out_specs=out_specs, check_vma=check_vma)
  return jax.jit(f)(xs, res, w)


def reference(x, r, w, keep_bf16=False, **kw):
  """psum + the XLA reference op: what every strategy must equal (residual_out: the psum when
  there is no residual)."""
  h = lax.psum(x, AXIS)
  out = rmsnorm_quant(h, w, residual=r, keep_hp=keep_bf16, implementation="xla", **kw)
  return out.quant, h if r is None else out.residual


def assert_replicated(tree):
  """Every device holds the whole array, bit for bit the same."""
  for a in jax.tree.leaves(tree):
    shards = a.addressable_shards
    assert len(shards) == len(a.sharding.device_set) > 0
    first = np.asarray(shards[0].data)
    assert first.shape == a.shape
    for s in shards[1:]:
      assert np.asarray(s.data).tobytes() == first.tobytes(), f"device {s.device} differs"


def assert_matches(got, want, strategy):
  (gq, gr), (wq, wr) = got, want
  if strategy == "ar_norm_then_quant":
    assert_quant_close(gq, wq, scale_rtol=AR_SCALE_RTOL, code_frac=AR_CODE_FRAC)
  else:
    assert_quant_close(gq, wq)
  assert (gq.hp is None) == (wq.hp is None)
  if wq.hp is not None:
    assert_rounded_close(gq.hp, wq.hp)
  # The same psum and the same f32 add rounded once: no freedom at all.
  np.testing.assert_array_equal(np.asarray(gr, np.float32), np.asarray(wr, np.float32))


CASES = {
    "t1_h4096": dict(shape=(1, 4096)),
    "t5_h2112_bf16": dict(shape=(5, 2112), keep_bf16=True),
    "t16_h576": dict(shape=(16, 576)),
    "lead_h576_nores_bf16": dict(shape=(2, 3, 576), residual=False, keep_bf16=True),
}


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("case", CASES)
def test_strategies_match_reference(n, case):
  c = dict(CASES[case])
  xs, res, w = inputs(("strategies", n, case), n, c["shape"], c.get("residual", True))
  keep = c.get("keep_bf16", False)

  def body(x, r, w):
    outs = {s: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, keep_bf16=keep, strategy=s)
            for s in STRATEGIES}
    return outs, reference(x, r, w, keep)

  outs, want = sharded(n, body, xs, res, w)
  assert_replicated((outs, want))
  for s in STRATEGIES:
    assert outs[s][0].q.shape == c["shape"] and outs[s][1].dtype == jnp.bfloat16
    assert_matches(outs[s], want, s)
  # The reduction really sums the N partials: bf16 sums, each rounding within 2**-8 of the
  # running magnitude, so |error| <= (N + 1) 2**-8 (sum |x_i| + |residual|).
  x64 = np.asarray(xs, np.float64)
  r64 = 0.0 if res is None else np.asarray(res, np.float64)
  bound = (n + 1) * 2.0**-8 * (np.abs(x64).sum(0) + np.abs(r64))
  assert np.all(np.abs(np.asarray(want[1], np.float64) - (x64.sum(0) + r64)) <= bound)


OPTIONS = {
    "offset1": dict(weight_offset=1.0),
    "col": dict(layout="col"),
    "ue8m0": dict(ue8m0=True),
    "g64_fnuz": dict(group_size=64, fmt=FORMATS["e4m3fnuz"]),
    "fnuz_224_eps": dict(fmt=FORMATS["e4m3fnuz_224"], eps=1e-2),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_options(option):
  opt = OPTIONS[option]
  xs, res, w = inputs(("options", option), 2, (4, 2112))

  def body(x, r, w):
    outs = {s: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, strategy=s, **opt)
            for s in STRATEGIES}
    # ar_norm_then_quant is exactly the unfused composition of the two XLA ops.
    y, _ = rmsnorm(lax.psum(x, AXIS), w, residual=r, eps=opt.get("eps", 1e-6),
                   weight_offset=opt.get("weight_offset", 0.0), implementation="xla")
    qkw = {k: v for k, v in opt.items() if k not in ("eps", "weight_offset")}
    return outs, reference(x, r, w, **opt), group_quant(y, implementation="xla", **qkw)

  outs, want, unfused = sharded(2, body, xs, res, w)
  assert_replicated(outs)
  assert_matches(outs["fused"], want, "fused")
  assert_matches(outs["generic"], want, "generic")
  assert_quant_close(outs["ar_norm_then_quant"][0], unfused)
  if not opt.get("ue8m0"):
    # With UE8M0 a bf16-rounded amax can cross a power of two and halve a scale, so there only
    # the exact composition above is a fair comparison.
    assert_matches(outs["ar_norm_then_quant"], want, "ar_norm_then_quant")


def test_default_chain_and_log(caplog):
  xs, res, w = inputs(("default",), 4, (3, 576))
  assert chosen_strategy(res, w, residual=res) == "fused"
  with caplog.at_level(logging.INFO, logger="jfusedq"):
    for _ in range(2):  # two traces, one log line
      got = sharded(4, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS), xs, res,
                    w)
  logged = [r.getMessage() for r in caplog.records]
  assert [m for m in logged if m.startswith("allreduce_rmsnorm_quant")] == [
      "allreduce_rmsnorm_quant: strategy fused on cpu"]
  assert_matches(got, sharded(4, reference, xs, res, w), "fused")


@pytest.mark.parametrize("value,want", [("1", "ar_norm_then_quant"), ("0", "fused")])
def test_env_opt_out(monkeypatch, caplog, value, want):
  monkeypatch.setenv(DISABLE_ENV, value)
  xs, res, w = inputs(("env",), 2, (2, 2112))
  assert chosen_strategy(res, w, residual=res, keep_bf16=True) == want
  with caplog.at_level(logging.INFO, logger="jfusedq"):
    got = sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS,
                                                             keep_bf16=True), xs, res, w)
  assert f"strategy {want} on cpu" in caplog.text
  assert_matches(got, sharded(2, lambda *a: reference(*a, keep_bf16=True), xs, res, w), want)
  if value == "1":
    assert "skipped fused (disabled by" in caplog.text
    # An explicit request for the disabled strategy is refused, naming the variable.
    with pytest.raises(Unsupported, match=DISABLE_ENV):
      sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS,
                                                         strategy="fused"), xs, res, w)


def test_gated_off_falls_through(monkeypatch, caplog):
  monkeypatch.setattr(allreduce, "gate", lambda name: "forced off" if name == "fused" else None)
  xs, res, w = inputs(("gate",), 2, (3, 576))
  assert chosen_strategy(res, w, residual=res) == "ar_norm_then_quant"
  with caplog.at_level(logging.INFO, logger="jfusedq"):
    got = sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS), xs, res,
                  w)
  assert "strategy ar_norm_then_quant on cpu; skipped fused (forced off)" in caplog.text
  assert_matches(got, sharded(2, reference, xs, res, w), "ar_norm_then_quant")
  with pytest.raises(Unsupported, match="forced off"):
    chosen_strategy(res, w, strategy="fused")


def test_op_decline_falls_through(monkeypatch):
  """A strategy whose op raises Unsupported falls through; named alone, it raises."""
  def declines(*args, **kwargs):
    raise Unsupported("test: fused kernel unavailable")

  monkeypatch.setitem(allreduce.BUILDERS, "fused", declines)
  xs, res, w = inputs(("decline",), 2, (3, 576))
  assert chosen_strategy(res, w, residual=res) == "ar_norm_then_quant"
  got = sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS), xs, res, w)
  assert_matches(got, sharded(2, reference, xs, res, w), "ar_norm_then_quant")
  with pytest.raises(Unsupported, match="fused kernel unavailable"):
    chosen_strategy(res, w, residual=res, strategy="fused")
  assert chosen_strategy(res, w, strategy=("fused", "generic")) == "generic"


def test_implementations_override(caplog):
  """`implementations` sets the order where strategy=None; an explicit strategy still wins, a
  name there falls back no more than one passed directly, and the block's end restores it."""
  xs, res, w = inputs(("override",), 2, (3, 576))
  with implementations(allreduce_rmsnorm_quant="generic"):
    assert chosen_strategy(res, w, residual=res) == "generic"
    assert chosen_strategy(res, w, residual=res, strategy="fused") == "fused"
    with caplog.at_level(logging.INFO, logger="jfusedq"):
      got = sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS), xs,
                    res, w)
    with implementations(allreduce_rmsnorm_quant=("ar_norm_then_quant", "generic")):
      assert chosen_strategy(res, w, residual=res) == "ar_norm_then_quant"
    assert chosen_strategy(res, w, residual=res) == "generic"
  assert chosen_strategy(res, w, residual=res) == "fused"
  assert "allreduce_rmsnorm_quant: strategy generic on cpu" in caplog.text
  assert_matches(got, sharded(2, reference, xs, res, w), "generic")
  # The sequence-parallel entry reads the same key (its log line names it).
  xs4, _, _ = inputs(("override_sp",), 2, (4, 576), residual=False)
  with implementations(allreduce_rmsnorm_quant="generic"), caplog.at_level(logging.INFO,
                                                                           logger="jfusedq"):
    sharded(2, lambda x, r, w: reduce_scatter_rmsnorm_quant(x, None, w, axis_name=AXIS)[0], xs4,
            None, w)
  assert "reduce_scatter_rmsnorm_quant: strategy generic on cpu" in caplog.text


def test_implementations_override_named_and_ops(monkeypatch):
  """An overriding name is explicit (no fallback past a declined or gated-off strategy); an
  op's override reaches the strategies that call it with implementation=None."""
  monkeypatch.setattr(allreduce, "gate", lambda name: "forced off" if name == "fused" else None)
  xs, res, w = inputs(("override_named",), 2, (2, 4097))
  with implementations(allreduce_rmsnorm_quant="fused"):
    with pytest.raises(Unsupported, match="forced off"):
      chosen_strategy(res, w, residual=res)
  # 4097 columns: the Pallas kernels decline, so with Pallas forced on the ops ar_norm_then_quant
  # falls through to generic; with the XLA paths forced it builds.
  with implementations(rmsnorm="pallas", group_quant="pallas"):
    assert chosen_strategy(res, w, residual=res) == "generic"
  with implementations(rmsnorm="xla", group_quant="xla"):
    assert chosen_strategy(res, w, residual=res) == "ar_norm_then_quant"
  with pytest.raises(ValueError, match="unknown strategy"):
    with implementations(allreduce_rmsnorm_quant="fast"):
      pass


def test_pallas_decline_reaches_generic():
  """A row the Pallas kernels cannot tile (4097 = 4097 one-column chunks): with Pallas asked
  for, fused and ar_norm_then_quant both decline and generic runs."""
  xs, res, w = inputs(("untileable",), 2, (2, 4097))
  assert chosen_strategy(res, w, residual=res, implementation="pallas") == "generic"
  got = sharded(2, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS,
                                                           implementation="pallas"), xs, res, w)
  assert_matches(got, sharded(2, reference, xs, res, w), "generic")
  with pytest.raises(Unsupported, match="pallas"):
    chosen_strategy(res, w, implementation="pallas", strategy="fused")
  with pytest.raises(Unsupported, match="no strategy"):
    chosen_strategy(res, w, implementation="pallas", strategy=("fused", "ar_norm_then_quant"))


def test_pallas_inside_shard_map():
  """The Pallas kernels (interpret mode on CPU) run inside shard_map with check_vma=False."""
  xs, res, w = inputs(("pallas",), 2, (2, 576))

  def body(x, r, w):
    return ({s: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, strategy=s, keep_bf16=True,
                                        implementation="pallas")
             for s in ("fused", "ar_norm_then_quant")}, reference(x, r, w, keep_bf16=True))

  outs, want = sharded(2, body, xs, res, w)
  assert_replicated(outs)
  for s, got in outs.items():
    assert_matches(got, want, s)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("layout,keep", [("row", False), ("col", True)])
def test_sequence_parallel_equals_replicated(n, layout, keep):
  xs, res, w = inputs(("sp", n, layout), n, (16, 2112))
  kw = dict(axis_name=AXIS, layout=layout, keep_bf16=keep)
  # Each device gets its token shard of the residual; residual_out comes back sharded.
  sp = sharded(n, lambda x, r, w: reduce_scatter_rmsnorm_quant(x, r, w, **kw), xs, res, w,
               out_specs=(P(), P(AXIS)), res_spec=P(AXIS))
  rep = sharded(n, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, **kw), xs, res, w)
  assert_replicated(sp[0])
  assert sp[1].sharding.spec == P(AXIS) and sp[1].shape == (16, 2112)
  # Not bit-equal: XLA compiles the norm for T/N rows with reductions in another order (a few
  # f32 ulps on scales, seen on CPU), and reduce-scatter may add the partials in another order
  # than all-reduce (a bf16 rounding on the sum): hence the op tolerances.
  assert_quant_close(sp[0], rep[0])
  assert_rounded_close(sp[1], rep[1])
  if keep:
    assert_rounded_close(sp[0].hp, rep[0].hp)


def test_sequence_parallel_token_axis_and_strategies():
  """Tokens on axis -2 of `[B, T, H]`, no residual, each local strategy."""
  xs, _, w = inputs(("sp_axis",), 4, (2, 8, 576), residual=False)

  def body(x, r, w):
    sp = {s: reduce_scatter_rmsnorm_quant(x, None, w, axis_name=AXIS, token_axis=-2, strategy=s)
          for s in STRATEGIES}
    return sp, reference(x, None, w)

  specs = ({s: (P(), P(None, AXIS)) for s in STRATEGIES}, P())
  sp, want = sharded(4, body, xs, None, w, out_specs=specs)
  for s, (quant, res_out) in sp.items():
    assert quant.q.shape == res_out.shape == (2, 8, 576)
    # With no residual, residual_out is the scattered sum: this device's tokens of the psum.
    assert_rounded_close(res_out, want[1])
    ar = s == "ar_norm_then_quant"
    tol = dict(scale_rtol=AR_SCALE_RTOL, code_frac=AR_CODE_FRAC) if ar else {}
    assert_quant_close(quant, want[0], **tol)


def test_sharded_wrapper():
  """Global arrays in, on an Explicit mesh (jax.make_mesh's default) and an Auto one."""
  xs, res, w = inputs(("wrapper",), 4, (8, 576))
  want = sharded(4, lambda *a: reference(*a, keep_bf16=True), xs, res, w)
  for m in (jax.make_mesh((4,), (AXIS,)), mesh(4)):
    got = jax.jit(lambda xs, r, w: allreduce_rmsnorm_quant_sharded(
        xs, r, w, mesh=m, axis_name=AXIS, keep_bf16=True))(xs, res, w)
    assert_replicated(got)
    assert_matches(got, want, "fused")
    q, res_out = allreduce_rmsnorm_quant_sharded(xs, res, w, mesh=m, axis_name=AXIS,
                                                 sequence_parallel=True)
    assert res_out.sharding.spec == P(AXIS)
    assert_quant_close(q, want[0])
    assert_rounded_close(res_out, want[1])


def test_check_vma_true():
  """Inside a user's shard_map with check_vma=True (XLA ops only): outputs type as replicated."""
  xs, res, w = inputs(("vma",), 4, (8, 576))

  def body(x, r, w):
    rep = allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, strategy="generic")
    sp = reduce_scatter_rmsnorm_quant(x, None, w, axis_name=AXIS)
    return rep, sp[0]

  rep, sp = sharded(4, body, xs, res, w, check_vma=True)
  assert_matches(rep, sharded(4, reference, xs, res, w), "generic")
  assert_replicated(sp)


@pytest.mark.parametrize("sp", [False, True])
def test_axis_size_one(sp):
  """One device: no collective at all, and the result is the single-device op's: the same fp8,
  bf16 and residual bits, scales within two ulp."""
  xs, res, w = inputs(("one", sp), 1, (4, 2112))
  if sp:
    fn = lambda x, r, w: reduce_scatter_rmsnorm_quant(x, r, w, axis_name=AXIS, keep_bf16=True)
  else:
    fn = lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, keep_bf16=True)
  f = jax.jit(jax.shard_map(lambda x, r, w: fn(x[0], r, w), mesh=mesh(1),
                            in_specs=(P(AXIS), P(), P()), out_specs=P(), check_vma=False))
  text = f.lower(xs, res, w).as_text()
  assert not any(c in text for c in ("all_reduce", "reduce_scatter", "all_gather"))
  got = f(xs, res, w)
  want = rmsnorm_quant(xs[0], w, residual=res, keep_hp=True, implementation="xla")
  for u, v in zip(jax.tree.leaves(got), jax.tree.leaves((want.quant, want.residual))):
    if u.dtype == jnp.float32:
      # The same XLA ops compiled inside shard_map may sum a row's squares in another order:
      # the row's RMS factor can land an f32 ulp apart, and a scale (its group's largest
      # |h * factor * w| over the format's max, three roundings later) 2 ulp apart, as seen for
      # one row of four in the sequence-parallel case; q, hp and the residual agree to the bit.
      np.testing.assert_array_max_ulp(np.asarray(u), np.asarray(v), maxulp=2)
    else:
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_errors():
  xs, res, w = inputs(("errors",), 4, (6, 576))
  call = lambda **kw: lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name=AXIS, **kw)
  with pytest.raises(ValueError, match="'model' is not a mesh axis in scope"):
    sharded(4, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w, axis_name="model"), xs, res, w)
  with pytest.raises(ValueError, match="'tp' is not a mesh axis in scope.*none"):
    allreduce_rmsnorm_quant(xs[0], res, w, axis_name=AXIS)
  with pytest.raises(ValueError, match="residual shape"):
    sharded(4, lambda x, r, w: allreduce_rmsnorm_quant(x, r[:3], w, axis_name=AXIS), xs, res, w)
  with pytest.raises(ValueError, match="weight shape"):
    sharded(4, lambda x, r, w: allreduce_rmsnorm_quant(x, r, w[:-1], axis_name=AXIS), xs, res, w)
  with pytest.raises(ValueError, match="unknown strategy"):
    sharded(4, call(strategy="fast"), xs, res, w)
  with pytest.raises(ValueError, match="reduce_scatter_rmsnorm_quant"):
    sharded(4, call(strategy="sequence_parallel"), xs, res, w)
  # Sequence-parallel: 6 tokens over 4 devices; a residual that is not this device's shard.
  with pytest.raises(ValueError, match="T=6 tokens over 4 devices"):
    sharded(4, lambda x, r, w: reduce_scatter_rmsnorm_quant(x, None, w, axis_name=AXIS), xs, res,
            w)
  xs8, res8, w8 = inputs(("errors8",), 4, (8, 576))
  with pytest.raises(ValueError, match="token shard"):
    sharded(4, lambda x, r, w: reduce_scatter_rmsnorm_quant(x, r, w, axis_name=AXIS), xs8, res8,
            w8)
  with pytest.raises(ValueError, match="token_axis"):
    sharded(4, lambda x, r, w: reduce_scatter_rmsnorm_quant(x, None, w, axis_name=AXIS,
                                                            token_axis=1), xs8, res8, w8)
  with pytest.raises(ValueError, match=r"want shape \[4, \.\.\., H\]"):
    allreduce_rmsnorm_quant_sharded(xs[:3], res, w, mesh=mesh(4), axis_name=AXIS)
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    allreduce_rmsnorm_quant_sharded(xs, res, w, mesh=mesh(4), axis_name="model")


LOWER_STRATEGIES = {"fused": 1, "ar_norm_then_quant": 2, "sequence_parallel": 1}


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("strategy", LOWER_STRATEGIES)
def test_lowers_for_gpu_targets(target, n, strategy):
  """The sharded call lowers, with the Triton kernel(s) after the collective, for each GPU."""
  kind, platform = TARGETS[target]
  am = AbstractMesh((n,), (AXIS,), abstract_device=AbstractDevice(kind, None, platform))
  sp = strategy == "sequence_parallel"

  def fn(xs, r, w):
    return allreduce_rmsnorm_quant_sharded(xs, r, w, mesh=am, axis_name=AXIS, keep_bf16=True,
                                           strategy=None if sp else strategy,
                                           sequence_parallel=sp, implementation="pallas")

  with jax.sharding.use_abstract_mesh(am):
    text = jax.jit(fn).trace(S((n, 16, 4096), jnp.bfloat16), S((16, 4096), jnp.bfloat16),
                             S((4096,), jnp.bfloat16)).lower().as_text()
    # With no implementation asked for, a GPU target picks the fused kernel.
    assert chosen_strategy(S((16, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16)) == "fused"
  assert text.count(TRITON_CALL) == LOWER_STRATEGIES[strategy]
  if sp:
    gathers = [line for line in text.splitlines() if '"stablehlo.all_gather"' in line]
    assert "stablehlo.reduce_scatter" in text and "stablehlo.all_reduce" not in text
    # fp8 codes travel as bytes: ui8 gathers, never an fp8 one.
    assert any("xui8>" in line for line in gathers)
    assert not any("xf8E4M3" in line for line in gathers)
  else:
    assert "stablehlo.all_reduce" in text
  assert ("f8E4M3FNUZ" in text) == (target == "gfx942")


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
def test_default_implementation_on_gpu_targets(target):
  """implementation=None on a GPU target: the fused strategy runs the Pallas kernel."""
  kind, platform = TARGETS[target]
  am = AbstractMesh((2,), (AXIS,), abstract_device=AbstractDevice(kind, None, platform))
  fn = lambda xs, r, w: allreduce_rmsnorm_quant_sharded(xs, r, w, mesh=am, axis_name=AXIS)
  with jax.sharding.use_abstract_mesh(am):
    text = jax.jit(fn).trace(S((2, 4, 2112), jnp.bfloat16), S((4, 2112), jnp.bfloat16),
                             S((2112,), jnp.bfloat16)).lower().as_text()
  assert text.count(TRITON_CALL) == 1 and "stablehlo.all_reduce" in text

