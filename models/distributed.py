"""Multi-process runs: one process per host (or per GPU) under `jax.distributed`, one global mesh.

Every process runs the same program on the same inputs; JAX runs the collectives across
processes (NCCL on GPUs, gloo on CPUs). Settings come from flags or, when a flag is left out,
from what `jax.distributed.initialize` reads itself: `JAX_COORDINATOR_ADDRESS`, and the process
count and id of a SLURM, Open MPI or Kubernetes job.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
  g = parser.add_argument_group("several processes (jax.distributed)")
  g.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                 help="host:port of process 0 (default $JAX_COORDINATOR_ADDRESS); set on every "
                      "process to run as one of several")
  g.add_argument("--num-processes", type=int,
                 help="processes in all (default: from the SLURM / Open MPI job)")
  g.add_argument("--process-id", type=int,
                 help="this process's index, 0 .. num-processes - 1 (default: from the job)")


def initialize(args: argparse.Namespace) -> bool:
  """Joins the processes when any setting is given (before anything touches a device); the
  devices of every process then form `jax.devices()`. Returns whether it did."""
  if args.coordinator is None and args.num_processes is None and args.process_id is None:
    return False
  import jax  # here, not at the top: the CLI imports JAX only once its arguments are good
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)
  return True


def is_main() -> bool:
  """Whether this process prints and writes results (process 0; every process holds them)."""
  import jax
  return jax.process_index() == 0
