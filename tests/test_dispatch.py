"""The shared dispatcher: default order, explicit names, fall-through, the log, and the
`implementations` override of the default order."""

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfusedq
from jfusedq import Unsupported, _target, implementations
from jfusedq.ops import _dispatch


@pytest.fixture(autouse=True)
def _fresh_log():
  _dispatch._logged.clear()


def backends(calls, decline=()):
  def make(name):
    def run():
      calls.append(name)
      if name in decline:
        raise Unsupported(f"{name} says no")
      return name
    return run
  return {name: make(name) for name in ("a", "b", "c")}


def test_resolve_order_fallthrough_and_log(caplog):
  calls = []
  with caplog.at_level(logging.INFO, logger="jfusedq"):
    for _ in range(2):
      assert _dispatch.resolve("op", backends(calls, decline=("a",)), None,
                               default=("a", "b", "c")) == ("b", "b")
  assert calls == ["a", "b", "a", "b"]
  assert [r.getMessage() for r in caplog.records] == [
      f"op: implementation b on {_target.current().platform}; skipped a (a says no)"]
  # A sequence is tried in order; a string never falls back.
  assert _dispatch.resolve("op", backends([], decline=("c",)), ("c", "a"), default=())[0] == "a"
  with pytest.raises(Unsupported, match="'a' was requested but cannot run this call: a says no"):
    _dispatch.resolve("op", backends([], decline=("a",)), "a", default=("b",))
  with pytest.raises(Unsupported, match="no implementation could run"):
    _dispatch.resolve("op", backends([], decline=("a", "b")), ("a", "b"), default=())
  with pytest.raises(jfusedq.InputError, match="unknown implementation"):
    _dispatch.resolve("op", backends([]), "d", default=())


def test_resolve_gate():
  gate = lambda name: "off" if name == "a" else None
  assert _dispatch.resolve("op", backends([]), None, default=("a", "b"), gate=gate)[0] == "b"
  with pytest.raises(Unsupported, match="'a' was requested but is unavailable: off"):
    _dispatch.resolve("op", backends([]), "a", default=(), gate=gate)


def test_implementations_sets_the_default_only():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 256)), jnp.bfloat16)
  seen = []
  with implementations(group_quant="pallas"):
    assert _dispatch.requested("group_quant", None) == "pallas"
    assert _dispatch.requested("group_quant", "xla") == "xla"  # an explicit argument wins
    assert _dispatch.requested("rmsnorm", None) is None
    with implementations(group_quant=("triton", "xla"), rmsnorm="xla"):
      assert _dispatch.requested("group_quant", None) == ("triton", "xla")
      assert _dispatch.requested("rmsnorm", None) == "xla"
      with implementations(group_quant=None):
        assert _dispatch.requested("group_quant", None) is None
    assert _dispatch.requested("group_quant", None) == "pallas"
    # Another thread starts from its own (empty) context.
    t = threading.Thread(target=lambda: seen.append(_dispatch.requested("group_quant", None)))
    t.start()
    t.join()
  assert seen == [None] and _dispatch.requested("group_quant", None) is None
  with pytest.raises(jfusedq.InputError, match="unknown op"):
    with implementations(group_qaunt="xla"):
      pass
  with pytest.raises(jfusedq.InputError, match="unknown implementation"):
    with implementations(fp8_matmul="cublas"):
      pass
  # The override is read at trace time and picks the backend the op runs.
  with implementations(group_quant="pallas"), pytest.raises(Unsupported, match="pallas"):
    jfusedq.group_quant(jnp.zeros((2, 4097), jnp.bfloat16))  # no Pallas tiling of 4097 columns
  got = jax.jit(lambda x: jfusedq.group_quant(x).q)(x)
  with implementations(group_quant="pallas"):
    np.testing.assert_array_equal(np.asarray(jfusedq.group_quant(x).q, np.float32),
                                  np.asarray(got, np.float32))


def test_fp8_matmul_override_reaches_its_quantisation(monkeypatch):
  """An fp8_matmul override counts as the argument, so its bf16 input is quantised on the same
  terms as when the value is passed (XLA here)."""
  from jfusedq.nn.weights import quantize_weight
  from jfusedq.ops.fp8_matmul import api
  from jfusedq.ops.group_quant import api as gq_api
  calls = []

  def spy(op, backends, implementation, **kw):
    calls.append((op, implementation))
    return _dispatch.dispatch(op, backends, implementation, **kw)

  monkeypatch.setattr(api, "dispatch", spy)
  monkeypatch.setattr(gq_api, "dispatch", spy)
  w, s = quantize_weight(jnp.ones((128, 256)), "e4m3fn")
  with implementations(fp8_matmul="xla"):
    api.fp8_matmul(jnp.ones((2, 256), jnp.bfloat16), w, s)
  assert calls == [("group_quant", ("xla",)), ("fp8_matmul", "xla")]


def test_among_keeps_the_names_an_op_declares():
  # A model's one implementation setting reaches each op as the names that op has, so a
  # setting naming Pallas runs the ragged products (no Pallas kernel) in their own order.
  assert _dispatch.among("ragged_fp8_matmul", ("pallas", "xla")) == ("xla",)
  assert _dispatch.among("ragged_fp8_matmul", "pallas") is None
  assert _dispatch.among("fp8_matmul", ("pallas", "xla")) == ("pallas", "xla")
  assert _dispatch.among("mla_decode", None) is None
