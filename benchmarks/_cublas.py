"""cuBLAS's blockwise FP8 GEMM, through PyTorch's `torch.nn.functional.scaled_mm`: the peer the
GEMM benchmarks hold `jf.fp8_matmul` to. It runs in a process of its own, started by
fp8_matmul.py, so that torch's profiler and JAX's never share one.

The DeepSeek format as `scaled_mm` takes it (its shape and stride checks):
  mat_a    the activation's codes `[M, K]`, row-major;
  scale_a  `ScalingType.BlockWise1x128`: `[M, ceil(K/128)]`, outer-dim-major (strides (1, M));
  mat_b    the weight's codes `[N, K]` seen as `[K, N]` (column-major);
  scale_b  `ScalingType.BlockWise128x128`: the weight's `[ceil(N/128), ceil(K/128)]` scales
           padded along K to L4 = a multiple of 4 and transposed: `[L4, ceil(N/128)]`, strides
           (1, L4).
Both scales multiply the codes, as jfusedq's do. cuBLAS needs K and N to be multiples of 16.

Timing, as `_harness.measure` times ours: a distinct copy of the operands per call (so the L2
serves no call another's reads) and every output kept to the end of the pass, a warm-up pass
(cuBLAS picks its kernel on a shape's first call), then one pass under `torch.profiler`; a
call's time is the sum of its
kernels' durations (memsets and copies included). `time_us` is the mean over the calls (the
harness's figure), with the median and p10 / p90. The output checked by fp8_matmul.py is that of
one more call in float32 (bf16 where cuBLAS declines float32), every `step`-th row.

  python benchmarks/_cublas.py --probe  torch's version, scaled_mm's signature and docstring,
                                        small blockwise calls checked against a float64 emulation
  python benchmarks/_cublas.py DIR      the cases of DIR/cases.json (from fp8_matmul.py):
                                        DIR/results.json (rewritten after every case) and
                                        DIR/<id>_out.npy
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

BLOCK = 128
# The profiler's device-side categories: what the harness sums from the device plane's streams.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def member(enum, name: str):
  """`enum`'s member called `name`, however the release spells it (BlockWise1x128 /
  Blockwise_1x128)."""
  want = name.lower().replace("_", "")
  for key, value in enum.__members__.items():
    if key.lower().replace("_", "") == want:
      return value
  raise RuntimeError(f"{enum.__name__} has no {name}: {list(enum.__members__)}")


def api():
  """(torch, scaled_mm, activation recipe, weight recipe), or raises naming what is missing."""
  import torch
  import torch.nn.functional as F
  scaled_mm = getattr(F, "scaled_mm", None)
  scaling = getattr(F, "ScalingType", None)
  if scaled_mm is None or scaling is None:
    raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm / "
                       f"ScalingType (found: {[n for n in dir(F) if 'scal' in n.lower()]})")
  return (torch, scaled_mm, member(scaling, "BlockWise1x128"),
          member(scaling, "BlockWise128x128"))


def layout(torch, a, a_scale, w, w_scale):
  """Device tensors as scaled_mm takes them (module docstring), each in fresh memory.

  a `[M, K]` / w `[N, K]` uint8 codes, a_scale `[M, kb]` / w_scale `[nb, kb]` float32 (torch
  tensors on the device)."""
  (m, kb), nb = a_scale.shape, w_scale.shape[0]
  l4 = -(-kb // 4) * 4
  mat_a = a.clone().view(torch.float8_e4m3fn)
  mat_b = w.clone().view(torch.float8_e4m3fn).t()
  # Strides set outright: `.t().contiguous().t()` keeps (kb, 1) at M = 1 (a size-1 axis counts
  # as contiguous either way), which scaled_mm's stride check rejects.
  scale_a = torch.empty_strided((m, kb), (1, m), dtype=torch.float32, device=a.device)
  scale_a.copy_(a_scale)
  scale_b = torch.empty_strided((l4, nb), (1, l4), dtype=torch.float32, device=w.device).zero_()
  scale_b[:kb].copy_(w_scale.t())
  return mat_a, mat_b, scale_a, scale_b


def kernel_spans(prof, path: str) -> list[tuple[float, float, str]]:
  """(start us, duration us, name) of the profiled device activity, in start order."""
  prof.export_chrome_trace(path)
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  spans = [(float(e["ts"]), float(e["dur"]), e.get("name", "")) for e in events
           if e.get("ph") == "X" and str(e.get("cat", "")).lower() in DEVICE_CATS]
  return sorted(spans)


def spread(per_call: list[float]) -> dict:
  if len(per_call) < 3:
    return {"median_us": None, "p10_us": None, "p90_us": None}
  q = statistics.quantiles(per_call, n=10, method="inclusive")
  return {"median_us": round(statistics.median(per_call), 3), "p10_us": round(q[0], 3),
          "p90_us": round(q[-1], 3)}


def run_case(torch, scaled_mm, recipes, case: dict, d: str) -> dict:
  i, calls, step = case["id"], case["calls"], case["step"]
  load = lambda part: torch.from_numpy(np.load(os.path.join(d, f"{i}_{part}.npy"))).cuda()
  a, a_scale, w, w_scale = load("a"), load("a_scale"), load("w"), load("w_scale")
  copies = [layout(torch, a, a_scale, w, w_scale) for _ in range(calls)]
  del a, w
  rec_a, rec_b = recipes
  call = lambda ops, dtype: scaled_mm(ops[0], ops[1], ops[2], rec_a, ops[3], rec_b,
                                      output_dtype=dtype)
  try:
    out, out_dtype = call(copies[0], torch.float32), "float32"
  except Exception as e:  # noqa: BLE001  (a release without float32 output: say so, use bf16)
    print(f"case {i}: float32 output declined ({str(e).splitlines()[0][:200]}); checking bf16")
    out, out_dtype = call(copies[0], torch.bfloat16), "bfloat16"
  np.save(os.path.join(d, f"{i}_out.npy"), out[::step].float().cpu().numpy())
  del out
  # Every output kept until the pass ends, as a jit's are: each call writes fresh memory.
  outs = [call(ops, torch.bfloat16) for ops in copies]
  torch.cuda.synchronize()
  del outs
  acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
  with torch.profiler.profile(activities=acts) as prof:
    outs = [call(ops, torch.bfloat16) for ops in copies]
    torch.cuda.synchronize()
  del outs
  with tempfile.TemporaryDirectory() as t:
    spans = kernel_spans(prof, os.path.join(t, "trace.json"))
  if not spans:
    raise RuntimeError("the profiler recorded no device activity")
  total = sum(dur for _, dur, _ in spans)
  # Calls run one after another on one stream: with the same kernels per call, the spans in
  # start order are the calls' kernels in turn.
  per = len(spans) // calls if len(spans) % calls == 0 else None
  per_call = [sum(dur for _, dur, _ in spans[c * per:(c + 1) * per]) for c in range(calls)
              ] if per else []
  by_name: dict[str, float] = {}
  for _, dur, name in spans:
    by_name[name[:80]] = by_name.get(name[:80], 0.0) + dur
  top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
  return {"time_us": round(total / calls, 3), **spread(per_call), "calls": calls,
          "kernels_per_call": len(spans) / calls, "out_dtype": out_dtype,
          "top_kernels": {k: round(v / calls, 3) for k, v in top}}


def run(d: str) -> int:
  with open(os.path.join(d, "cases.json")) as f:
    cases = json.load(f)["cases"]
  results = {"cases": {}}
  path = os.path.join(d, "results.json")

  def save():
    with open(path + ".tmp", "w") as f:
      json.dump(results, f)
    os.replace(path + ".tmp", path)

  try:
    torch, scaled_mm, rec_a, rec_b = api()
    if not torch.cuda.is_available():
      raise RuntimeError("torch sees no CUDA device")
    results["peer"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) "
                       f"scaled_mm {rec_a.name} x {rec_b.name}")
  except Exception as e:  # noqa: BLE001  (the caller reports why the column is missing)
    results["skipped"] = f"{type(e).__name__}: {e}"
    save()
    print(results["skipped"])
    return 0
  save()
  print(results["peer"], flush=True)
  for case in cases:
    t0 = time.perf_counter()
    try:
      res = run_case(torch, scaled_mm, (rec_a, rec_b), case, d)
    except Exception as e:  # noqa: BLE001  (one shape cuBLAS declines leaves the others)
      res = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    torch.cuda.empty_cache()
    results["cases"][str(case["id"])] = res
    save()
    print(f"cuBLAS M={case['M']} N={case['N']} K={case['K']}: "
          f"{res.get('time_us', res.get('error'))} us ({time.perf_counter() - t0:.1f} s)",
          flush=True)
  return 0


def emulate(torch, a, a_scale, w, w_scale):
  """The block-scaled product in float64 from the codes and scales: the probe's reference."""
  k = a.shape[1]
  da = a.double() * a_scale.double().repeat_interleave(BLOCK, 1)[:, :k]
  dw = w.double() * w_scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(
      BLOCK, 1)[:w.shape[0], :k]
  return da @ dw.t()


def quantize(torch, x, rows: int):
  """Per `rows` x 128 block quantisation of a float32 `[R, K]` to e4m3fn codes (uint8) and
  float32 multiplying scales, as jfusedq's group_quant / quantize_weight make them."""
  r, k = x.shape
  pr, pk = -(-r // rows) * rows, -(-k // BLOCK) * BLOCK
  xp = torch.nn.functional.pad(x, (0, pk - k, 0, pr - r))
  blocks = xp.reshape(pr // rows, rows, pk // BLOCK, BLOCK)
  amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
  scale = amax / 448.0
  q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
  q = q.reshape(pr, pk)[:r, :k].contiguous()
  return q.view(torch.uint8), scale.float()


def probe() -> int:
  """Prints what the GPU run rests on, in seconds: the API and small checked calls."""
  import torch
  print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuda available: {torch.cuda.is_available()}")
  if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name(0)}, capability "
          f"{torch.cuda.get_device_capability(0)}")
  F = torch.nn.functional
  for name in ("scaled_mm", "scaled_grouped_mm"):
    fn = getattr(F, name, None)
    print(f"\nF.{name}: " + ("missing" if fn is None else f"{inspect.signature(fn)}"))
    if fn is not None and name == "scaled_mm":
      print(inspect.getdoc(fn))
  for enum in ("ScalingType", "SwizzleType"):
    e = getattr(F, enum, None)
    print(f"F.{enum}: {None if e is None else {k: v.value for k, v in e.__members__.items()}}")
  _, scaled_mm, rec_a, rec_b = api()
  failed = 0
  # A padded 128 x 128 scale (K = 640: 5 blocks, L4 = 8), a partial N block (N = 2112), M = 1.
  for m, n, k in ((256, 384, 640), (1, 2112, 512), (64, 2112, 7168), (16, 24576, 1536)):
    g = torch.Generator().manual_seed(m + n + k)
    qa, sa = quantize(torch, torch.randn(m, k, generator=g), 1)
    qw, sw = quantize(torch, torch.randn(n, k, generator=g), BLOCK)
    want = emulate(torch, qa.view(torch.float8_e4m3fn).float(), sa,
                   qw.view(torch.float8_e4m3fn).float(), sw)
    ops = layout(torch, qa.cuda(), sa.cuda(), qw.cuda(), sw.cuda())
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2.0**-7)):
      try:
        got = scaled_mm(ops[0], ops[1], ops[2], rec_a, ops[3], rec_b, output_dtype=dtype)
        err = float((got.double().cpu() - want).norm() / want.norm())
        ok = err <= tol
        failed += not ok
        print(f"M={m} N={n} K={k} {str(dtype)[6:]}: rel RMS error vs f64 emulation {err:.3g} "
              f"({'ok' if ok else 'FAILED'}, tolerance {tol:.3g}); scale_a {tuple(ops[2].shape)} "
              f"strides {ops[2].stride()}, scale_b {tuple(ops[3].shape)} strides "
              f"{ops[3].stride()}")
      except Exception:  # noqa: BLE001  (the probe reports every failure)
        failed += 1
        print(f"M={m} N={n} K={k} {dtype}: FAILED\n{traceback.format_exc(limit=3)}")
  grouped = getattr(F, "scaled_grouped_mm", None)
  if grouped is not None:
    # Two experts of the same weight, 128 rows each: whether a grouped blockwise call builds.
    ops = layout(torch, qa.cuda()[:1].repeat(256, 1), sa.cuda()[:1].repeat(256, 1), qw.cuda(),
                 sw.cuda())
    experts = torch.stack([ops[1].t(), ops[1].t()]).transpose(-2, -1)  # [2, K, N], K-major
    try:
      grouped(ops[0], experts, ops[2], rec_a, torch.stack([ops[3], ops[3]]), rec_b,
              offs=torch.tensor([128, 256], device="cuda", dtype=torch.int32),
              output_dtype=torch.bfloat16)
      print("\nscaled_grouped_mm with blockwise 1x128 / 128x128 scales: built")
    except Exception as e:  # noqa: BLE001
      print(f"\nscaled_grouped_mm with blockwise 1x128 / 128x128 scales: declined "
            f"({type(e).__name__}: {str(e).splitlines()[0][:300]})")
  # The timed path itself (files, copies, profiler, per-call sums) on the last shape.
  with tempfile.TemporaryDirectory() as d:
    for part, t in (("a", qa), ("a_scale", sa), ("w", qw), ("w_scale", sw)):
      np.save(os.path.join(d, f"0_{part}.npy"), t.numpy())
    case = dict(id=0, M=qa.shape[0], N=qw.shape[0], K=qa.shape[1], calls=8, step=1)
    try:
      res = run_case(torch, scaled_mm, (rec_a, rec_b), case, d)
      print(f"\ntimed as a case: {res}")
      failed += res["median_us"] is None
    except Exception:  # noqa: BLE001
      failed += 1
      print(f"\ntimed as a case: FAILED\n{traceback.format_exc(limit=3)}")
  print(f"\nprobe: {'all calls ok' if not failed else f'{failed} FAILED'}")
  return 1 if failed else 0


def main(argv: list[str]) -> int:
  if argv == ["--probe"]:
    return probe()
  if len(argv) != 1 or not os.path.isdir(argv[0]):
    print(__doc__.split("\n\n")[-1], file=sys.stderr)
    return 2
  return run(argv[0])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
