"""The `jfusedq` command (also `python -m models`).

  jfusedq run    one model three ways from one set of weights (bf16, FP8 unfused, FP8 fused):
                 per-step decode times, kernels per step, numerics against bf16 (the main job)
  jfusedq demo   the fused add + RMSNorm + FP8 quant op alone, on the default device
  jfusedq plot   a PNG of a benchmark results file, a chart per op it times

Bad input (an unknown preset, a checkpoint folder without config.json, a GGUF file of another
architecture, --tp that does not split the heads or the FP8 weight blocks, an --out that cannot
be written, ...) is reported as one line on stderr with exit status 2, checked before anything
is built or compiled; JAX is imported only once the arguments are known good (`--help` and
argument errors never import it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from models import distributed
from models.presets import PRESETS


class UsageError(Exception):
  """Bad arguments or input: one line on stderr, exit status 2, no traceback."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{self.prog}: {message}")


def _positive(text: str) -> int:
  try:
    v = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if v <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
  return v


def _input_errors() -> tuple[type[BaseException], ...]:
  """The library's errors about its input (an argument, a checkpoint's content, a file's
  format): reported like bad arguments. Anything else is a bug and keeps its traceback."""
  from jfusedq import JfusedqError
  from jfusedq.checkpoint import CheckpointError
  from jfusedq.checkpoint.safetensors import SafetensorsError
  return JfusedqError, CheckpointError, SafetensorsError


def demo(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jfusedq import _target, default_format, rmsnorm_quant
  from jfusedq.ops._dispatch import Unsupported, default_order
  from jfusedq.testing import quant_mismatch

  target = _target.current()
  fmt = default_format()
  print(f"jax {jax.__version__} on {target.platform} ({target.device_kind}); fp8 format {fmt.name}"
        f" (max {fmt.max:g})")
  t, h = args.tokens, args.hidden
  k = jax.random.split(jax.random.key(args.seed), 3)
  x = jax.random.normal(k[0], (t, h), jnp.bfloat16)
  residual = jax.random.normal(k[1], (t, h), jnp.bfloat16)
  weight = (1.0 + 0.1 * jax.random.normal(k[2], (h,))).astype(jnp.bfloat16)
  print(f"input x [{t}, {h}] bf16 + residual; group size 128")

  impls = list(default_order(target))
  if "pallas" not in impls:
    impls.append("pallas")  # CPU: Pallas runs in interpret mode (correct, not fast)
  results = {}
  for impl in impls:
    fn = jax.jit(lambda x, r, w, impl=impl: rmsnorm_quant(x, w, residual=r, implementation=impl))
    try:
      out = jax.block_until_ready(fn(x, residual, weight))
    except Unsupported as e:  # e.g. triton without a GPU
      print(f"  {impl:>6}: skipped ({e})")
      continue
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x, residual, weight))
      times.append(time.perf_counter() - t0)
    results[impl] = out
    slow = ("; Pallas runs in interpret mode on CPU (its kernel emulated one grid step at a time):"
            " a check of its results, not a speed" if impl == "pallas" and _target.interpret()
            else "")
    print(f"  {impl:>6}: median {np.median(times) * 1e6:9.1f} us per call (wall clock, includes"
          f" dispatch){slow}")
  ref = results["xla"].quant
  q = results[next(iter(results))].quant
  print(f"q {q.q.shape} {q.q.dtype}, scale {q.scale.shape} {q.scale.dtype}")
  print("row 0, first 8 codes :", np.asarray(q.q[0, :8].astype(jnp.float32)))
  print("row 0, first 4 scales:", np.asarray(q.scale[0, :4]))
  deq = np.asarray(q.dequantize())
  exact = np.asarray(jax.jit(lambda x, r, w: rmsnorm_quant(x, w, residual=r, implementation="xla",
                                                           keep_hp=True))(x, residual, weight)
                     .quant.hp, np.float32)
  print(f"dequantised vs bf16 norm output: relative RMS error "
        f"{np.linalg.norm(deq - exact) / np.linalg.norm(exact):.4f}")
  for impl in impls:
    if impl != "xla":
      why = quant_mismatch(results[impl].quant, ref, max_code_frac=1e-3, scale_rtol=1e-6)
      print(f"{impl} vs xla: {'agree' if why is None else 'DISAGREE: ' + why}")
      if why:
        return 1
  return 0


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def _hf_config(args) -> dict | None:
  """The preset's or the checkpoint folder's config dict (None for a GGUF file, whose
  metadata `_check_model` reads), or UsageError naming what is wrong."""
  if not args.checkpoint:
    if args.model not in PRESETS:
      raise UsageError(f"unknown preset {args.model!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[args.model]
  path = args.checkpoint
  if path.endswith(".gguf"):
    if not os.path.isfile(path):
      raise UsageError(f"checkpoint {path}: no such file")
    with open(path, "rb") as f:
      if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
        raise UsageError(f"checkpoint {path}: not a GGUF file (it does not start with "
                         f"{GGUF_MAGIC!r})")
    return None
  if not os.path.exists(path):
    raise UsageError(f"checkpoint {path}: no such folder")
  if not os.path.isdir(path):
    raise UsageError(f"checkpoint {path}: not a folder (a Hugging Face checkpoint is a folder "
                     f"with config.json and *.safetensors; a GGUF file's name ends in .gguf)")
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    raise UsageError(f"checkpoint {path}: no config.json in the folder")
  try:
    with open(config) as f:
      hf = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UsageError(f"{config}: unreadable ({e})") from None
  if not isinstance(hf, dict):
    raise UsageError(f"{config}: not a JSON object")
  return hf


def _check_model(hf: dict | None, tp: int, where: str, fp8: bool) -> None:
  """Supported model_type (hf None: the GGUF file `where`, a Llama architecture) and, for
  `tp` > 1, a model that splits over `tp` devices: its heads (`check_tp`) and, with `fp8`, its
  FP8 weights in whole 128 x 128 blocks per device. Checked on the model built abstractly
  (`nnx.eval_shape`: shapes only, no weights); the error names the --tp values that work."""
  from flax import nnx

  from jfusedq import JfusedqError
  from models import registry
  from models.common import checkpoint_quant, sharding
  try:
    if hf is None:
      fam, cfg = registry.gguf_config(where)
    else:
      fam = registry.family(hf.get("model_type"))
      cfg = fam.config.from_hf(hf)
    if tp == 1:
      return
    # The FP8 paths' projections, as the run builds or loads them (a checkpoint's
    # modules_to_not_convert, as config.json names them, stay unquantised: no blocks to split).
    quant = checkpoint_quant((hf or {}).get("quantization_config"), True, None) if fp8 else False
    model = nnx.eval_shape(lambda: fam.model(cfg, fp8=quant, tp_axis="tp", rngs=nnx.Rngs(0)))
    try:
      sharding.split_specs(model, nnx.state(model), tp)
    except ValueError as e:
      sizes = ", ".join(map(str, sharding.tp_sizes(model)))
      raise UsageError(f"{where}: --tp {tp}: {e}; --tp values that work here: {sizes}") from None
  except (ValueError, JfusedqError) as e:
    raise UsageError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
  except ModuleNotFoundError as e:
    if e.name != "gguf":
      raise
    raise UsageError(f"{where}: reading a GGUF file needs the gguf package (pip install gguf)"
                     ) from None


class _Progress:
  """Each phase as a line on stderr; on a terminal, rich's spinner (with the elapsed time) over
  phases of unknown length and its bar over the decode rounds."""

  def __init__(self):
    self.live = sys.stderr.isatty()

  def say(self, msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

  def _progress(self, *columns):
    from rich.console import Console
    from rich.progress import Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), *columns, TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)

  @contextlib.contextmanager
  def spin(self, label: str):
    if not self.live:
      yield
      return
    from rich.progress import SpinnerColumn
    with self._progress(SpinnerColumn()) as p:
      p.add_task(label, total=None)
      yield

  @contextlib.contextmanager
  def bar(self, label: str, total: int):
    if not self.live:
      yield lambda: None
      return
    from rich.progress import BarColumn, MofNCompleteColumn
    with self._progress(BarColumn(), MofNCompleteColumn()) as p:
      task = p.add_task(label, total=total)
      yield lambda: p.advance(task)


def _output(out: str, default_name: str, suffix: str) -> str:
  """The file an `--out OUT` option names: OUT itself when it ends in `suffix` (and is no
  existing folder), else OUT/`default_name`, OUT a folder. The folder is created now, so a
  path that cannot be written fails before the work rather than after it."""
  is_file = out.endswith(suffix) and not os.path.isdir(out)
  folder = (os.path.dirname(out) or ".") if is_file else out
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise UsageError(f"--out {out}: {folder} is a file, not a folder (give a folder for "
                     f"{default_name}, or a file name ending in {suffix})")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--out {out}: cannot create the folder {folder} ({e.strerror})") from None
  if not os.access(folder, os.W_OK):
    raise UsageError(f"--out {out}: the folder {folder} is not writable")
  return out if is_file else os.path.join(folder, default_name)


def run(args) -> int:
  hf = _hf_config(args)
  where = args.checkpoint or args.model
  name = os.path.basename(os.path.normpath(where)).removesuffix(".gguf")
  out = _output(args.out, f"run_{name}.json", ".json") if args.out else None
  if args.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulated CPU devices for --tp on a machine without accelerators; ignored by GPU backends.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.tp}").strip()
  # Imported once XLA_FLAGS holds the device count: JAX reads it when its backend starts.
  import jax
  distributed.initialize(args)
  n = jax.device_count()
  if args.tp > n:
    raise UsageError(f"--tp {args.tp} needs {args.tp} devices; {n} available")
  if n % args.tp:
    raise UsageError(f"--tp {args.tp} does not divide the {n} devices")
  _check_model(hf, args.tp, where, fp8=set(args.paths) != {"bf16"})
  from models import run as runner
  progress = _Progress()
  result = runner.run(args.model if not args.checkpoint else None, args.checkpoint,
                      batch=args.batch, prompt_len=args.prompt_len, steps=args.steps,
                      repeats=args.repeats, tp=args.tp, paths=args.paths, seed=args.seed,
                      progress=progress)
  if not distributed.is_main():
    return 0  # every process holds the results; process 0 prints them
  print(runner.table(result))
  if out:
    with open(out, "w") as f:
      json.dump(runner.to_json(result), f, indent=1, default=float)
    print(f"wrote {out}")
  return 0


def case_labels(cases: list[dict]) -> list[str]:
  """A bar group's name: every case key that varies across the file (a key some cases lack
  included), as key=value where the case has it."""
  keys = list(dict.fromkeys(k for c in cases for k in c))
  varying = [k for k in keys if len({json.dumps(c.get(k)) for c in cases}) > 1]
  return [",".join(f"{k}={c[k]}" for k in varying if k in c) for c in cases]


def _benchmark_rows(path: str) -> dict:
  """A benchmark results file (benchmarks/results/*.json) whose rows each have a time, or
  UsageError saying what the file is instead."""
  need = {"case", "impl", "time_us"}
  try:
    with open(path) as f:
      doc = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UsageError(f"{path}: unreadable ({e})") from None
  if isinstance(doc, dict) and "paths" in doc and "rows" not in doc:
    raise UsageError(f"{path}: a `jfusedq run` result, whose figures are the table `jfusedq run` "
                     f"prints; plot draws a benchmark results file (benchmarks/results/*.json)")
  rows = doc.get("rows") if isinstance(doc, dict) else None
  if not isinstance(rows, list) or not rows:
    raise UsageError(f"{path}: no list of \"rows\": not a benchmark results file "
                     f"(benchmarks/results/*.json)")
  bad = [need - set(r) if isinstance(r, dict) else need for r in rows
         if not isinstance(r, dict) or not need <= set(r)]
  if bad:
    raise UsageError(f"{path}: rows without {sorted(bad[0])}: plot draws time_us per case and "
                     f"implementation")
  return doc


def panels(rows: list[dict], benchmark: str) -> dict[str, list[dict]]:
  """The rows of each op a results file times, by the case's "op" (the rmsnorm_quant
  benchmark also times group_quant alone), its own op where the case names none: one chart
  each, as their times are of different work."""
  out: dict[str, list[dict]] = {}
  for r in rows:
    out.setdefault(str(r["case"].get("op", benchmark)), []).append(r)
  return out


def plot(args) -> int:
  """PNG of a benchmark results file: time per case for each implementation, a chart per op."""
  doc = _benchmark_rows(args.results)
  stem = os.path.splitext(os.path.basename(args.results))[0]
  if args.out is None:
    folder = os.path.dirname(args.results) or "."
    if not os.access(folder, os.W_OK):
      raise UsageError(f"{folder} is not writable, so {stem}.png cannot go next to "
                       f"{args.results}: give --out")
    path = os.path.join(folder, f"{stem}.png")
  else:
    path = _output(args.out, f"{stem}.png", ".png")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
  except ImportError:
    raise UsageError("jfusedq plot needs matplotlib: pip install 'jfusedq[plot]'") from None
  benchmark = doc.get("benchmark", stem)
  # An implementation named with "(...)" is another figure of one already drawn (e.g. its
  # wall time beside its kernel time), not an implementation of its own.
  rows = [r for r in doc["rows"] if "(" not in r["impl"]]
  groups = panels(rows, benchmark)
  cases = [case_labels(list({json.dumps(r["case"], sort_keys=True): r["case"] for r in g}
                            .values())) for g in groups.values()]
  # Inches: half a one per case; a chart 3.5 high over its labels, a 7-point character of a
  # label rotated by 60 degrees reaching about 0.05 down.
  width = max(8, 0.5 * max(map(len, cases)))
  heights = [3.5 + 0.05 * max(map(len, labels)) for labels in cases]
  fig, axes = plt.subplots(len(groups), 1, figsize=(width, sum(heights)), squeeze=False,
                           height_ratios=heights, layout="constrained")
  for ax, (op, group) in zip(axes[:, 0], groups.items()):
    _bars(ax, group)
    if len(groups) > 1:
      ax.set_title(op)
    handles, names = ax.get_legend_handles_labels()
    if any(b.get_hatch() for b in ax.patches):
      handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx"))
      names.append("check failed")
    ax.legend(handles, names)
  fig.suptitle(f"{benchmark} on {doc.get('device', '?')} (jax {doc.get('jax', '?')}, "
               f"{doc.get('date', '?')})")
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")
  return 0


def _bars(ax, rows: list[dict]) -> None:
  """One bar per case and implementation, grouped by case, on a log scale; a row whose
  correctness check failed hatched (a time, never a speed-up)."""
  key = lambda r: json.dumps(r["case"], sort_keys=True)
  cases = list(dict.fromkeys(key(r) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  width = 0.8 / len(impls)
  for j, impl in enumerate(impls):
    by_case = {key(r): r for r in rows if r["impl"] == impl}
    xs = [i for i, c in enumerate(cases) if c in by_case]
    bars = ax.bar([x + j * width for x in xs], [by_case[cases[x]]["time_us"] for x in xs],
                  width, label=impl)
    for bar, x in zip(bars, xs):
      if by_case[cases[x]].get("correct") is False:
        bar.set_hatch("xx")
        bar.set_edgecolor("black")
  ax.set_yscale("log")
  ax.set_ylabel("time per call (us)")
  # Each label under the middle of its group, its end at the tick: rotated about that end.
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))],
                case_labels([json.loads(c) for c in cases]), rotation=60,
                horizontalalignment="right", rotation_mode="anchor", fontsize=7)
  ax.set_xlim(-0.5, len(cases) - 0.1)


EXAMPLES = """\
examples:
  jfusedq run                                 deepseek-v3-tiny with random weights, here
  jfusedq run --model llama-tiny --out runs/  another preset; the results also as JSON
  jfusedq run --checkpoint PATH               a Hugging Face folder or a Llama .gguf file
  jfusedq run --help                          every option and preset
  jfusedq demo                                the fused op alone
  jfusedq plot benchmarks/results/rmsnorm_quant.json
"""


def parser() -> _Parser:
  ap = _Parser(prog="jfusedq", description="FP8 inference with fused RMSNorm + quantisation: a "
               "model's decode step\nthree ways (bf16, FP8 unfused, FP8 fused), the fused op "
               "alone, and plots of\nbenchmark results.", epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", title="commands", metavar="COMMAND", parser_class=_Parser)
  r = sub.add_parser("run", help="a model three ways (bf16, FP8 unfused, FP8 fused): decode "
                                 "step times, kernels per step, numerics against bf16")
  r.add_argument("--model", default="deepseek-v3-tiny",
                 help=f"preset: {', '.join(PRESETS)} (default %(default)s)")
  r.add_argument("--checkpoint", help="a Hugging Face checkpoint folder (config.json + "
                                      "*.safetensors) or a Llama GGUF file (*.gguf) instead of "
                                      "a preset")
  r.add_argument("--batch", type=_positive, default=2, help="sequences (default %(default)s)")
  r.add_argument("--prompt-len", type=_positive, default=16,
                 help="prompt tokens, the positions the numerics compare (default %(default)s)")
  r.add_argument("--steps", type=_positive, default=32,
                 help="decode steps a round, in calls of up to 8 launched back to back "
                 "(default %(default)s)")
  r.add_argument("--repeats", type=_positive, default=20,
                 help="timed rounds after a warm-up one: the median and p10-p90 per step are "
                      "over these (default %(default)s)")
  r.add_argument("--tp", type=_positive, default=1,
                 help="tensor-parallel devices (default %(default)s). On a machine without "
                      "GPUs, jfusedq simulates N CPU devices in this one process: the split "
                      "runs, but its times say nothing of a multi-GPU run")
  r.add_argument("--paths", nargs="+", choices=("bf16", "unfused", "fused"),
                 default=["bf16", "unfused", "fused"], help="paths to run (default all three)")
  r.add_argument("--out", help="where to write the results as JSON: a file name ending in "
                               ".json, or a folder (created if needed) for run_<model>.json")
  r.add_argument("--seed", type=int, default=0,
                 help="seed of the random weights and prompt (default %(default)s)")
  distributed.add_arguments(r)
  d = sub.add_parser("demo", help="fused add + RMSNorm + FP8 quant alone on the default "
                                  "device, each implementation timed and checked against XLA")
  d.add_argument("--tokens", type=_positive, default=64, help="rows (default %(default)s)")
  d.add_argument("--hidden", type=_positive, default=7168,
                 help="hidden size (default %(default)s)")
  d.add_argument("--reps", type=_positive, default=20,
                 help="timed calls per implementation (default %(default)s)")
  d.add_argument("--seed", type=int, default=0, help="seed of the inputs (default %(default)s)")
  p = sub.add_parser("plot", help="PNG of a benchmark results file (benchmarks/results/*.json)")
  p.add_argument("results", help="a benchmark results file, e.g. "
                                 "benchmarks/results/rmsnorm_quant.json")
  p.add_argument("--out", help="a file name ending in .png, or a folder (created if needed) for "
                               "<results name>.png (default: next to the results file)")
  return ap


def main(argv=None) -> int:
  ap = parser()
  try:
    args = ap.parse_args(argv)
    if args.cmd is None:  # bare `jfusedq`: what it can do, not a missing-argument error
      ap.print_help()
      return 2
    return {"demo": demo, "run": run, "plot": plot}[args.cmd](args)
  except UsageError as e:
    print(e if str(e).startswith("jfusedq") else f"jfusedq: {e}", file=sys.stderr)
    return 2
  except Exception as e:
    # Tested here, not in an `except` clause of its own: that clause's expression would run
    # (importing JAX) for every exception passing through, `--help`'s SystemExit included.
    if not isinstance(e, _input_errors()):
      raise
    print(f"jfusedq: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
