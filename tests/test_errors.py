"""Bad input at each public boundary (ops, layers, models, checkpoint loading) raises jfusedq's
own error (`jfusedq.errors`, `jfusedq.checkpoint.CheckpointError`) naming the argument, before
anything is traced; traced token ids and positions follow the documented clamp, or raise under
`debug_checks()`."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jfusedq as jf
from jfusedq import errors
from jfusedq.checkpoint import (Checkpoint, CheckpointError, ConfigError, MissingTensorError,
                                TensorMismatchError, load_linear, save_file)
from jfusedq.fp8 import Fp8Format, QuantizedActivation
from jfusedq.nn import Fp8Linear, Linear, RMSNorm, quantize_weight
from tests import helpers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if ROOT not in sys.path:  # `models` is a top-level directory of the repository
  sys.path.insert(0, ROOT)
from models import llama, registry  # noqa: E402
from models.common.layers import check_generate  # noqa: E402
from models.common.loading import UnusedTensorsWarning  # noqa: E402
from tests.models.test_llama import hf_config, tensors  # noqa: E402

InputError, DTypeError = errors.InputError, errors.DTypeError

X = jnp.ones((4, 256), jnp.bfloat16)
W8 = jnp.zeros((128, 256), jnp.float8_e4m3fn)
S8 = jnp.ones((1, 2), jnp.float32)


def _mesh1():
  return jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])


def _qa(group_size):
  q = jnp.zeros((4, 256), jnp.float8_e4m3fn)
  return QuantizedActivation(q, jnp.ones((4, 256 // group_size), jnp.float32),
                             group_size=group_size)


OPS = {
    "gq_int_x": (lambda: jf.group_quant(X.astype(jnp.int32)), DTypeError, "x must be"),
    "gq_list_x": (lambda: jf.group_quant([[1.0]]), InputError, "x must be an array"),
    "gq_scalar_x": (lambda: jf.group_quant(jnp.float32(1)), InputError, "x must have"),
    "gq_empty_k": (lambda: jf.group_quant(jnp.zeros((4, 0))), InputError, "x has an empty"),
    "gq_group_size": (lambda: jf.group_quant(X, group_size=100), InputError, "group_size"),
    "gq_layout": (lambda: jf.group_quant(X, layout="diag"), InputError, "layout"),
    "gq_fmt": (lambda: jf.group_quant(X, fmt="e5m2"), InputError, "fmt"),
    "rq_weight_shape": (lambda: jf.rmsnorm_quant(X, jnp.ones(128)), InputError, "weight shape"),
    "rq_weight_dtype": (lambda: jf.rmsnorm_quant(X, jnp.ones(256, jnp.int32)), DTypeError,
                        "weight must be"),
    "rq_empty_h": (lambda: jf.rmsnorm_quant(jnp.zeros((4, 0)), jnp.ones(0)), InputError,
                   "x has an empty hidden axis"),
    "rq_residual_dtype": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), residual=X.astype(
        jnp.float32)), DTypeError, "residual dtype"),
    "rq_residual_shape": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), residual=X[:2]),
                          InputError, "residual shape"),
    "rq_x2_alone": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), x2=X), InputError, "x2"),
    "rmsnorm_weight": (lambda: jf.rmsnorm(X, jnp.ones(255)), InputError, "weight shape"),
    # eps < 0 (or NaN) would make the norm's rsqrt NaN: every scale NaN, silently.
    "rq_eps": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), eps=-1.0), InputError,
               "eps must be a number >= 0, got -1.0"),
    "rq_eps_nan": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), eps=float("nan")), InputError,
                   "eps must be a number >= 0, got nan"),
    "rq_eps2": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), x2=X, weight2=jnp.ones(256),
                                         eps2=-1e-6), InputError, "eps2 must be"),
    "rq_eps_none": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), eps=None), InputError,
                    "eps must be a number >= 0, got None"),
    "rmsnorm_eps": (lambda: jf.rmsnorm(X, jnp.ones(256), eps=-1e-6), InputError, "eps must be"),
    "ar_eps": (lambda: jf.chosen_strategy(X, jnp.ones(256), eps=-1.0), InputError,
               "eps must be"),
    "ar_sharded_eps": (lambda: jf.allreduce_rmsnorm_quant_sharded(
        X[None], None, jnp.ones(256), mesh=_mesh1(), axis_name="tp", eps=-1.0), InputError,
                       "eps must be"),
    "rs_eps": (lambda: jf.allreduce_rmsnorm_quant_sharded(
        X[None], None, jnp.ones(256), mesh=_mesh1(), axis_name="tp", sequence_parallel=True,
        eps=-1.0), InputError, "eps must be"),
    # A misspelt backend or strategy name is an input error like any other.
    "rq_impl": (lambda: jf.rmsnorm_quant(X, jnp.ones(256), implementation="palas"), InputError,
                "rmsnorm_quant: unknown implementation ['palas']"),
    "gq_impl": (lambda: jf.group_quant(X, implementation=("xla", "trition")), InputError,
                "unknown implementation ['trition']"),
    "mm_impl": (lambda: jf.fp8_matmul(_qa(128), W8, S8, implementation="cublas"), InputError,
                "fp8_matmul: unknown implementation"),
    # A bf16 input is quantised first: the error still names the GEMM, not its quantisation.
    "mm_impl_bf16": (lambda: jf.fp8_matmul(X, W8, S8, implementation="cublas"),
                     InputError, "fp8_matmul: unknown implementation"),
    "ragged_impl": (lambda: jf.ragged_fp8_matmul(X, W8[None], S8[None],
                                                 jnp.asarray([X.shape[0]]),
                                                 implementation="pallas"),
                    InputError, "ragged_fp8_matmul: unknown implementation"),
    "ar_strategy": (lambda: jf.chosen_strategy(X, jnp.ones(256), strategy="fusd"), InputError,
                    "unknown strategy ['fusd']"),
    "implementations_op": (lambda: jf.implementations(rmsnorm_qaunt="xla").__enter__(),
                           InputError, "unknown op 'rmsnorm_qaunt'"),
    "implementations_name": (lambda: jf.implementations(rmsnorm="tritn").__enter__(),
                             InputError, "rmsnorm: unknown implementation"),
    "mm_weight_dtype": (lambda: jf.fp8_matmul(X, W8.astype(jnp.bfloat16), S8), DTypeError,
                        "weight must be float8"),
    "mm_weight_rank": (lambda: jf.fp8_matmul(X, W8[0], S8), InputError, "weight must be [N, K]"),
    "mm_weight_empty": (lambda: jf.fp8_matmul(X, W8[:0], S8[:0]), InputError,
                        "weight has an empty axis"),
    "mm_scale_shape": (lambda: jf.fp8_matmul(X, W8, S8[:, :1]), InputError, "weight_scale shape"),
    "mm_scale_dtype": (lambda: jf.fp8_matmul(X, W8, S8.astype(jnp.bfloat16)), DTypeError,
                       "weight_scale must be float32"),
    "mm_k_mismatch": (lambda: jf.fp8_matmul(X[:, :128], W8, S8), InputError, "a has K = 128"),
    "mm_a_int": (lambda: jf.fp8_matmul(X.astype(jnp.int8), W8, S8), DTypeError, "a must be"),
    "mm_qa_group": (lambda: jf.fp8_matmul(_qa(64), W8, S8), InputError, "group_size=64"),
    "mm_qa_format": (lambda: jf.fp8_matmul(_qa(128), W8.astype(jnp.float8_e4m3fnuz), S8),
                     DTypeError, "activation is"),
    "grouped_ids": (lambda: jf.grouped_fp8_matmul(X[None], W8[None], S8[None],
                                                  jnp.zeros(2, jnp.float32)), InputError, "ids"),
    "grouped_groups": (lambda: jf.grouped_fp8_matmul(jnp.ones((3, 4, 256), jnp.bfloat16),
                                                     jnp.stack([W8] * 2), jnp.stack([S8] * 2)),
                       InputError, "activation groups"),
}


def _cases(table):
  return [pytest.param(*v, id=k) for k, v in table.items()]


@pytest.mark.parametrize("call, kind, message", _cases(OPS))
def test_ops(call, kind, message):
  with pytest.raises(kind, match=message.replace("[", r"\[")) as e:
    call()
  assert isinstance(e.value, errors.JfusedqError)


@pytest.mark.parametrize("impl", helpers.implementations("rmsnorm_quant"))
def test_empty_rows_give_empty_results(impl):
  """T = 0 (or batch 0) is a valid call with an empty result of the matching shapes."""
  x = jnp.zeros((0, 3, 256), jnp.bfloat16)
  qa = jf.group_quant(x, implementation=impl)
  assert qa.q.shape == (0, 3, 256) and qa.scale.shape == (0, 3, 2)
  out = jf.rmsnorm_quant(x, jnp.ones(256, jnp.bfloat16), residual=x, implementation=impl)
  assert out.quant.q.shape == (0, 3, 256) and out.residual.shape == (0, 3, 256)
  assert jf.fp8_matmul(x, W8, S8, implementation=impl).shape == (0, 3, 128)


def _rngs():
  return nnx.Rngs(0)


LAYERS = {
    "fp8linear_in": (lambda: Fp8Linear(0, 128, rngs=_rngs()), InputError, "in_features"),
    "linear_out": (lambda: Linear(128, -1, rngs=_rngs()), InputError, "out_features"),
    "rmsnorm_features": (lambda: RMSNorm(0, rngs=_rngs()), InputError, "num_features"),
    "rmsnorm_eps": (lambda: RMSNorm(8, eps=-1.0, rngs=_rngs()), InputError, "eps"),
    "fp8linear_x": (lambda: Fp8Linear(256, 128, rngs=_rngs())(X[:, :128]), InputError,
                    "Fp8Linear: x must be"),
    "linear_int_x": (lambda: Linear(256, 128, rngs=_rngs())(X.astype(jnp.int32)), DTypeError,
                     "Linear: x must be floating"),
    "linear_no_hp": (lambda: Linear(256, 128, rngs=_rngs())(_qa(128)), InputError, "hp"),
    "rmsnorm_x": (lambda: RMSNorm(128, rngs=_rngs())(X), InputError, "RMSNorm: x must be"),
    "rmsnorm_residual": (lambda: RMSNorm(256, rngs=_rngs())(X, X[:1]), InputError,
                         "residual shape"),
}


@pytest.mark.parametrize("call, kind, message", _cases(LAYERS))
def test_layers(call, kind, message):
  with pytest.raises(kind, match=message) as e:
    call()
  assert isinstance(e.value, errors.JfusedqError)


CFG = llama.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=64, tie_word_embeddings=False)
F32 = dict(fp8=False, dtype=jnp.float32, param_dtype=jnp.float32)


@pytest.fixture(scope="module")
def model():
  return llama.LlamaForCausalLM(CFG, rngs=nnx.Rngs(0), **F32)


def _ids(b=2, t=4):
  return jnp.zeros((b, t), jnp.int32)


MODELS = {
    "tokens_rank": (lambda m: m(jnp.zeros(4, jnp.int32)), InputError, "tokens must be \\[B, T\\]"),
    "tokens_float": (lambda m: m(jnp.zeros((2, 4))), DTypeError, "tokens must hold integer"),
    "tokens_list": (lambda m: m([[1, 2]]), InputError, "tokens must be an integer"),
    "batch_0": (lambda m: m(_ids(0, 4)), InputError, "batch and length"),
    "length_0": (lambda m: m(_ids(2, 0)), InputError, "batch and length"),
    "id_vocab": (lambda m: m(_ids().at[1, 2].set(64)), InputError, "tokens must lie in"),
    "id_negative": (lambda m: m(_ids().at[0, 0].set(-1)), InputError, "tokens must lie in"),
    "pos_negative": (lambda m: m(_ids(), pos=-1), InputError, "pos must be >= 0"),
    "pos_past_cache": (lambda m: m(_ids(1, 4), cache=m.init_cache(1, 8), pos=6), InputError,
                       "pos = 6"),
    "prefill_past_cache": (lambda m: m(_ids(1, 10), cache=m.init_cache(1, 8)), InputError,
                           "outside the cache"),
    "cache_batch": (lambda m: m.init_cache(0, 8), InputError, "batch"),
    "cache_len": (lambda m: m.init_cache(1, 0), InputError, "max_len"),
    "generate_steps": (lambda m: check_generate(batch=1, prompt_len=4, steps=5, max_len=8),
                       InputError, "prompt_len \\+ steps"),
    "generate_batch": (lambda m: check_generate(batch=-1, prompt_len=4, steps=0, max_len=8),
                       InputError, "batch"),
    "generate_prompt": (lambda m: check_generate(batch=1, prompt_len=0, steps=0, max_len=8),
                        InputError, "prompt_len"),
    "generate_negative_steps": (lambda m: check_generate(batch=1, prompt_len=2, steps=-1,
                                                         max_len=8), InputError, "steps"),
}


@pytest.mark.parametrize("call, kind, message", _cases(MODELS))
def test_models(model, call, kind, message):
  with pytest.raises(kind, match=message) as e:
    call(model)
  assert isinstance(e.value, errors.JfusedqError)


def _other_model(family: str):
  """A model of `family` with random weights, of the Hugging Face reference's (small) sizes."""
  if family == "deepseek_v3":
    from tests.models.ds_reference import ref_path as ref
  else:
    from tests.models.test_qwen3_5 import ref
  with open(os.path.join(ref("hf"), "config.json")) as f:
    return registry.build(json.load(f), **F32)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_every_model_checks_its_call(family):
  m = _other_model(family)
  for call, kind, message in (MODELS["tokens_rank"], MODELS["pos_past_cache"],
                              MODELS["cache_len"]):
    with pytest.raises(kind, match=message):
      call(m)
  with pytest.raises(InputError, match="tokens must lie in"):
    m(_ids().at[0, 0].set(m.cfg.vocab_size))


@nnx.jit
def _logits(m, ids):
  return m(ids).logits


def test_traced_ids_are_clamped(model):
  """Under jit an id outside [0, V) reads the nearest row (documented clamp): finite logits,
  equal to those of the clamped id, where the default gather filled NaN or wrapped."""
  ids = _ids().at[0, 1].set(64 + 5).at[1, 2].set(-3)
  got = np.asarray(_logits(model, ids))
  assert np.isfinite(got).all()
  want = np.asarray(_logits(model, _ids().at[0, 1].set(63).at[1, 2].set(0)))
  np.testing.assert_array_equal(got, want)


def test_debug_checks_raise_on_traced_ids_and_positions(model):
  with errors.debug_checks():
    f = nnx.jit(lambda m, ids: m(ids).logits)
    with pytest.raises(Exception, match="tokens must lie in"):
      jax.block_until_ready(f(model, _ids().at[0, 0].set(64)))
    step = nnx.jit(lambda m, ids, cache, pos: m(ids, cache=cache, pos=pos).logits)
    cache = model.init_cache(1, 8)
    jax.block_until_ready(step(model, _ids(1, 1), cache, jnp.int32(7)))  # the last slot: fine
    with pytest.raises(Exception, match="pos must lie in"):
      jax.block_until_ready(step(model, _ids(1, 1), cache, jnp.int32(8)))


def _save(path, m, *, config=True, drop=(), extra=None, edit=None):
  os.makedirs(path, exist_ok=True)
  if config:
    cfg = hf_config(m.cfg)
    if edit:
      cfg = edit(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(cfg, f)
  w = {k: v for k, v in tensors(m).items() if k not in drop}
  save_file({**w, **(extra or {})}, os.path.join(path, "model.safetensors"))
  return path


def _write_config(path, text):
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write(text)
  return path


NORM = "model.norm.weight"
CHECKPOINTS = {
    "no_directory": (lambda m, p: llama.from_pretrained(os.path.join(p, "nowhere"), **F32),
                     CheckpointError, "does not exist"),
    "no_config": (lambda m, p: llama.from_pretrained(_save(p, m, config=False), **F32),
                  ConfigError, "no config.json"),
    "registry_no_config": (lambda m, p: registry.from_pretrained(_save(p, m, config=False)),
                           ConfigError, "config.json does not exist"),
    "config_not_json": (lambda m, p: llama.from_pretrained(_write_config(_save(p, m), "{oops"),
                                                           **F32), ConfigError, "not valid JSON"),
    "config_not_object": (lambda m, p: llama.from_pretrained(_write_config(_save(p, m), "[1]"),
                                                             **F32), ConfigError, "not an object"),
    "config_key": (lambda m, p: llama.from_pretrained(_save(p, m, edit=lambda c: {
        k: v for k, v in c.items() if k != "vocab_size"}), **F32), ConfigError, "vocab_size"),
    "wrong_loader": (lambda m, p: llama.from_pretrained(_save(p, m, edit=lambda c: {
        **c, "model_type": "qwen3_next"}), **F32), ConfigError, "model_type 'qwen3_next'"),
    "registry_type": (lambda m, p: registry.from_pretrained(_save(p, m, edit=lambda c: {
        **c, "model_type": "gpt2"})), ConfigError, "'gpt2' is not supported"),
    "missing_tensor": (lambda m, p: llama.from_pretrained(_save(p, m, drop=(NORM,)), **F32),
                       MissingTensorError, NORM),
    "tensor_shape": (lambda m, p: llama.from_pretrained(_save(p, m, extra={
        NORM: np.ones(7, np.float32)}), **F32), TensorMismatchError, NORM),
    "tensor_dtype": (lambda m, p: llama.from_pretrained(_save(p, m, extra={
        NORM: np.ones(128, np.int32)}), **F32), TensorMismatchError, "dtype int32"),
}


@pytest.mark.parametrize("call, kind, message", _cases(CHECKPOINTS))
def test_checkpoint(model, tmp_path, call, kind, message):
  with pytest.raises(kind, match=message) as e:
    call(model, str(tmp_path))
  assert isinstance(e.value, errors.JfusedqError)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -1.0])
def test_checkpoint_scales_finite_and_positive(tmp_path, bad):
  q, s = quantize_weight(jnp.ones((128, 256), jnp.float32), Fp8Format.e4m3fn())
  s = np.array(s).copy()
  s[0, 1] = bad
  save_file({"p.weight": np.asarray(q).view(ml_dtypes.float8_e4m3fn), "p.weight_scale_inv": s},
            tmp_path / "model.safetensors")
  with pytest.raises(TensorMismatchError, match="p.weight_scale_inv.*finite and > 0"):
    load_linear(Checkpoint(tmp_path), "p", in_features=256, fmt="e4m3fn")


def test_unused_tensors_warn(model, tmp_path):
  path = _save(str(tmp_path), model, extra={"model.layers.9.extra.weight": np.ones(3, np.float32)})
  with pytest.warns(UnusedTensorsWarning, match="model.layers.9.extra.weight"):
    llama.from_pretrained(path, **F32)
