"""Shared harness of the multi-process tests: gloo on CPUs, or NCCL with one GPU per rank.

Process start-up dominates the time, so one spawn per world size runs every case of a test
module: each worker runs the module's ``CASES`` (name -> ``case(world, rank, group)``) and
reports a traceback per failing case, which the module's parametrized tests then read.
"""
import datetime
import importlib
import json
import os
import tempfile
import traceback
from contextlib import contextmanager
from typing import Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def close(actual, expected, what, tol=None):
    """``actual`` (compared in ``expected``'s dtype) within ``tol`` (atol = rtol) of
    ``expected``, or within float64 round-off without ``tol``."""
    atol, rtol = (1e-10, 1e-9) if tol is None else (tol, tol)
    actual = actual.to(expected.dtype)
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), (
        f"{what}: max abs error {(actual - expected).abs().max().item():.3g}")


@contextmanager
def no_communication():
    """Any collective or point-to-point call inside fails the case."""
    names = ("all_gather", "all_to_all", "all_reduce", "batch_isend_irecv",
             "reduce_scatter_tensor")
    saved = {name: getattr(dist, name) for name in names}

    def refuse(*args, **kwargs):
        raise AssertionError("communication before the input was checked")
    for name in names:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _worker(rank, world, init_file, result_dir, module_name, backend):
    torch.set_num_threads(1)
    cases = importlib.import_module(module_name).CASES
    options = {}
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60),
                            **options)
    group = dist.new_group(list(range(world)))
    results = {}
    for name, case in cases.items():
        try:
            case(world, rank, group)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case by the tests
            results[name] = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_cases(module_name: str, world: int,
              backend: str = "gloo") -> List[Dict[str, Optional[str]]]:
    """Spawns ``world`` processes that run ``module_name``'s CASES over ``backend`` ("gloo",
    or "nccl": rank r on GPU r, NVLink multicast off); per rank, case name -> traceback
    (None when it passed)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # NVLink multicast stays off (the children inherit the environment)
    env = dict(NCCL_NVLS_ENABLE="0") if backend == "nccl" else {}
    with scoped_env(**env), tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, module_name, backend),
                 nprocs=world)
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def scoped_env(**values: str):
    """Sets environment variables for the duration of the block, then restores them."""
    return mock.patch.dict(os.environ, values)


def assert_case_passed(results, case: str) -> None:
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)
