"""jfusedq.checkpoint: the safetensors reader/writer, checkpoint directories, FP8 projection
loading, and errors that name the tensor (HF-written files from `make hf-reference`)."""

import json
import os
import shutil
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ds_reference as ref
from helpers import rng
from jfusedq.checkpoint import (Checkpoint, CheckpointError, MissingTensorError, QuantConfig,
                                SafetensorsError, SafetensorsFile, TensorMismatchError,
                                load_file, load_linear, save_file)
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import quantize_weight
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.testing import code_index
from models import deepseek_v3 as ds

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, np.int64, np.int32, np.uint8, np.bool_]


def test_safetensors_roundtrip(tmp_path):
  r = rng("st")
  tensors = {f"t{i}.{np.dtype(d).name}": (r.standard_normal((3, 5 + i)) * 4).astype(d)
             for i, d in enumerate(DTYPES)}
  tensors["scalar"] = np.asarray(2.5, np.float32)
  tensors["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
  path = tmp_path / "x.safetensors"
  save_file(tensors, path, metadata={"format": "pt"})
  f = SafetensorsFile(path)
  assert f.metadata == {"format": "pt"} and set(f) == set(tensors)
  for k, v in tensors.items():
    assert f.spec(k) == (v.shape, v.dtype)
    np.testing.assert_array_equal(np.atleast_1d(f[k]).view(np.uint8),
                                  np.atleast_1d(v).view(np.uint8), err_msg=k)
  assert set(load_file(path)) == set(tensors)
  # A read by index: a range per axis sliced, other indices gathered (their outer product).
  v = tensors["t3.float8_e4m3fn"]
  for idx in ((np.arange(1, 3), np.arange(8)), (np.array([2, 0]), np.arange(2, 7, 2))):
    got = f.read("t3.float8_e4m3fn", idx)
    np.testing.assert_array_equal(got.view(np.uint8), v[np.ix_(*idx)].view(np.uint8))
    assert got.flags.writeable  # a copy, not a view of the memory map


def test_reads_pytorch_files():
  """Tensors written by PyTorch's safetensors: f32 (sharded, index), fp8 + bf16 (one file)."""
  hf, fp8 = Checkpoint(ref.ref_path("hf")), Checkpoint(ref.ref_path("fp8"))
  name = "model.layers.0.self_attn.q_b_proj.weight"
  w = hf[name]
  assert w.dtype == np.float32 and w.shape == (2048, 128)
  q = fp8[name]
  assert q.dtype == ml_dtypes.float8_e4m3fn
  s = fp8[name + "_scale_inv"]
  assert s.shape == (16, 1) and s.dtype == np.float32
  # PyTorch quantised the same weights: the codes are what quantize_weight gives, up to a step
  # where XLA's amax / 448 lands one f32 ulp from PyTorch's and w / scale sits at a midpoint.
  qq, ss = quantize_weight(jnp.asarray(w), Fp8Format.e4m3fn())
  np.testing.assert_allclose(np.asarray(ss), s, rtol=2.0**-23)
  steps = np.abs(code_index(qq) - code_index(q))
  assert steps.max() <= 1 and np.mean(steps) <= 1e-4
  assert fp8["model.norm.weight"].dtype == ml_dtypes.bfloat16
  assert set(hf.keys()) == {k for k in fp8.keys() if not k.endswith("_scale_inv")}


def test_checkpoint_layouts_and_scopes(tmp_path):
  r = rng("layouts")
  a = {"model.x.weight": r.standard_normal((4, 2)).astype(np.float32)}
  b = {"model.y.weight": r.standard_normal((3,)).astype(ml_dtypes.bfloat16)}
  # Several files without an index: their union.
  save_file(a, tmp_path / "a.safetensors")
  save_file(b, tmp_path / "b.safetensors")
  c = Checkpoint(tmp_path)
  assert sorted(c.keys()) == ["model.x.weight", "model.y.weight"]
  m = c.scope("model.")
  assert "x.weight" in m and sorted(m.keys()) == ["x.weight", "y.weight"]
  np.testing.assert_array_equal(m.scope("x.")["weight"], a["model.x.weight"])
  # An index naming a shard that is not there.
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.x.weight": "gone.safetensors"}}))
  with pytest.raises(CheckpointError, match="gone.safetensors"):
    Checkpoint(tmp_path)
  with pytest.raises(CheckpointError, match="does not exist"):
    Checkpoint(tmp_path / "nowhere")


def test_safetensors_corrupt_files(tmp_path):
  good = tmp_path / "good.safetensors"
  save_file({"w": np.ones((2, 3), np.float32) * 0.5}, good)
  raw = good.read_bytes()
  (tmp_path / "short.safetensors").write_bytes(raw[:5])
  with pytest.raises(SafetensorsError, match="too short"):
    SafetensorsFile(tmp_path / "short.safetensors")
  (tmp_path / "trunc.safetensors").write_bytes(raw[:-4])
  with pytest.raises(SafetensorsError, match="'w'.*data_offsets"):
    SafetensorsFile(tmp_path / "trunc.safetensors")
  (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
  with pytest.raises(SafetensorsError, match="header length"):
    SafetensorsFile(tmp_path / "huge.safetensors")
  header = b'{"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}'
  (tmp_path / "f4.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
  with pytest.raises(SafetensorsError, match="'w' has dtype F4"):
    SafetensorsFile(tmp_path / "f4.safetensors")


def test_get_checks_and_names_the_tensor():
  c = Checkpoint(ref.ref_path("fp8"), prefix="model.")
  with pytest.raises(MissingTensorError,
                     match=r"'model\.layers\.0\.self_attn\.q_c_proj\.weight' is missing"):
    c.get("layers.0.self_attn.q_c_proj.weight")
  with pytest.raises(TensorMismatchError,
                     match=r"'model\.layers\.0\.self_attn\.q_b_proj\.weight' has shape "
                           r"\[2048, 128\], expected \[2048, 256\]"):
    c.get("layers.0.self_attn.q_b_proj.weight", shape=(2048, 256))
  with pytest.raises(TensorMismatchError, match="has dtype float8_e4m3fn"):
    c.get("layers.0.self_attn.q_b_proj.weight", dtype=np.float32)


def _fp8_parts(r, ns, k):
  ws = [r.standard_normal((n, k)).astype(np.float32) for n in ns]
  return ws, [quantize_weight(jnp.asarray(w), Fp8Format.e4m3fn()) for w in ws]


@pytest.mark.parametrize("ns", [(128, 192), (100, 60)], ids=["aligned", "unaligned"])
def test_load_linear_concatenates_parts(tmp_path, ns):
  """q_a (N1) + kv_a (N2) from FP8 parts: block-exact concat when N1 % 128 == 0, else
  dequantised and quantised again as one weight."""
  r = rng("concat", ns)
  ws, qs = _fp8_parts(r, ns, 256)
  tensors = {}
  for i, (q, s) in enumerate(qs):
    tensors[f"p{i}.weight"] = np.asarray(q)
    tensors[f"p{i}.weight_scale_inv"] = np.asarray(s)
  # Some FP8 releases store bf16 scales: read as f32 (here exactly, rounded to bf16 first).
  qs[1] = (qs[1][0], qs[1][1].astype(jnp.bfloat16).astype(jnp.float32))
  tensors["p1.weight_scale_inv"] = np.asarray(qs[1][1].astype(jnp.bfloat16))
  save_file(tensors, tmp_path / "model.safetensors")
  c = Checkpoint(tmp_path)
  q, s = load_linear(c, ["p0", "p1"], in_features=256, out_features=list(ns),
                     fmt=Fp8Format.e4m3fn())
  assert q.shape == (sum(ns), 256) and s.shape == (-(-sum(ns) // 128), 2)
  if ns[0] % 128 == 0:
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                  np.concatenate([np.asarray(p[0]) for p in qs]).view(np.uint8))
  else:
    deq = np.concatenate([np.asarray(dequantize_weight(*p)) for p in qs])
    qq, ss = quantize_weight(jnp.asarray(deq), Fp8Format.e4m3fn())
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(qq).view(np.uint8))
  # Unquantised load: dequantised, in the asked dtype.
  w, none = load_linear(c, ["p0", "p1"], in_features=256, dtype=jnp.float32)
  assert none is None and w.dtype == jnp.float32
  np.testing.assert_array_equal(
      np.asarray(w), np.concatenate([np.asarray(dequantize_weight(*p)) for p in qs]))
  with pytest.raises(TensorMismatchError, match="'p1.weight' has shape"):
    load_linear(c, ["p0", "p1"], in_features=256, out_features=[ns[0], ns[1] + 1],
                fmt=Fp8Format.e4m3fn())
  with pytest.raises(TensorMismatchError, match="'p0.weight' has shape"):
    load_linear(c, ["p0"], in_features=128, fmt=Fp8Format.e4m3fn())


def test_quant_config():
  qc = QuantConfig.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic",
                            "modules_to_not_convert": ["lm_head", "layers.3.mlp"]}, "e4m3fnuz")
  assert qc.fmt == Fp8Format.e4m3fnuz()
  assert qc.quantizes("model.layers.2.mlp.down_proj")
  assert not qc.quantizes("model.layers.3.mlp.down_proj") and not qc.quantizes("lm_head")
  for bad, msg in (({"weight_block_size": [64, 64]}, "weight_block_size"),
                   ({"quant_method": "gptq"}, "quant_method"),
                   ({"activation_scheme": "static"}, "activation_scheme")):
    with pytest.raises(CheckpointError, match=msg):
      QuantConfig.from_hf(bad)


def _copy_fp8(tmp_path, edit):
  """The reference FP8 checkpoint with `edit(tensors, config)` applied, in tmp_path."""
  src = ref.ref_path("fp8")
  tensors = load_file(os.path.join(src, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  edit(tensors, config)
  dst = tmp_path / "ckpt"
  dst.mkdir()
  save_file(tensors, dst / "model.safetensors")
  (dst / "config.json").write_text(json.dumps(config))
  return dst


def test_model_load_errors_name_the_tensor(tmp_path):
  name = "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv"
  path = _copy_fp8(tmp_path, lambda t, c: t.pop(name))
  with pytest.raises(MissingTensorError, match=name.replace(".", r"\.")):
    ds.from_pretrained(path)
  shutil.rmtree(path)
  name = "model.layers.0.self_attn.kv_b_proj.weight"
  path = _copy_fp8(tmp_path, lambda t, c: t.update({name: t[name][:, :64]}))
  with pytest.raises(TensorMismatchError, match=name.replace(".", r"\.") + ".*shape"):
    ds.from_pretrained(path)
  shutil.rmtree(path)
  name = "model.layers.1.post_attention_layernorm.weight"
  path = _copy_fp8(tmp_path, lambda t, c: t.update({name: t[name][:-1]}))
  with pytest.raises(TensorMismatchError, match=name.replace(".", r"\.")):
    ds.from_pretrained(path)


def test_modules_to_not_convert(tmp_path):
  """A module excluded from FP8: its projections load as bf16 Linear, the rest stay FP8."""
  def edit(tensors, config):
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head",
                                                               "layers.0.self_attn.o_proj"]
  model = ds.from_pretrained(_copy_fp8(tmp_path, edit))
  attn = model.layers[0].self_attn
  assert attn.o_proj.weight[...].dtype == jnp.bfloat16
  assert attn.q_b_proj.weight[...].dtype == jnp.float8_e4m3fn
  assert model.layers[1].self_attn.o_proj.weight[...].dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("family, path, kw, tp", [
    ("ds", "fp8", {}, 2),  # FP8 as stored; q_a + kv_a concatenated; stacked experts
    ("ds", "fp8", dict(fmt="e4m3fnuz"), 2),  # codes reinterpreted, scales doubled
    ("ds", "hf", dict(fp8=True), 2),  # quantised on load
    ("ds", "fp8", dict(fp8=False), 2),  # dequantised
    ("qwen", "fp8", dict(fp8=True), 2),  # GDN rows permuted (qkv + z, b + a), conv channels
    ("qwen", "bf16_vlm", dict(fp8=True), 2),  # fused experts, quantised per expert
    ("qwen", "hf", dict(fp8=False, dtype=jnp.float32, param_dtype=jnp.float32), 4),
], ids=lambda v: v if isinstance(v, str) else None)
def test_load_onto_mesh(family, path, kw, tp):
  """A model loaded onto a mesh holds every parameter split as tp_apply splits it, with the
  bits of the one loaded whole (each shard read and built alone); under nnx.eval_shape (for its
  structure, as jfusedq run takes it) the same shapes."""
  import jax
  from flax import nnx
  from test_qwen3_5 import ref as qwen_ref

  from models import qwen3_5 as qw
  from models.common import param_names
  load, path = ((ds.from_pretrained, ref.ref_path(path)) if family == "ds" else
                (qw.from_pretrained, qwen_ref(path)))
  mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
  whole, split = load(path, tp_axis="tp", **kw), load(path, tp_axis="tp", mesh=mesh, **kw)
  state = nnx.state(split)
  specs = split.partition_specs(state)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  for (p, got), want, spec in zip(leaves, jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
    name = ".".join(param_names(p))
    assert got.sharding == jax.sharding.NamedSharding(mesh, spec), name
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(want).view(np.uint8), err_msg=name)
  abstract = nnx.eval_shape(lambda: load(path, tp_axis="tp", mesh=mesh, **kw))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(abstract)) == jax.tree.map(
      lambda a: (a.shape, a.dtype), state)


@pytest.mark.parametrize("fp8", [True, False])
def test_gguf_onto_mesh(tmp_path, fp8):
  """A GGUF Llama loaded onto a mesh (rows dequantised where a shard needs them, q/k rows
  unpermuted) holds the bits of the one loaded whole."""
  import dataclasses

  import jax
  from flax import nnx

  from models import llama
  from tests.models.llama_files import tensors, write_gguf
  from tests.models.test_llama import TP, build
  # GGUF keeps no head_dim (it is hidden / heads); FP8 shards of 128 rows over 2 devices.
  cfg = dataclasses.replace(TP, head_dim=TP.hidden_size // TP.num_heads)
  path = write_gguf(tmp_path / "tp.gguf", cfg, tensors(build(cfg, dtype=jnp.float32,
                                                             param_dtype=jnp.float32)))
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  whole = llama.from_pretrained(path, fp8=fp8, tp_axis="tp")
  split = llama.from_pretrained(path, fp8=fp8, tp_axis="tp", mesh=mesh)
  for got, want in zip(jax.tree.leaves(nnx.state(split)), jax.tree.leaves(nnx.state(whole))):
    assert got.sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
