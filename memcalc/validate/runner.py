"""Process management: one worker process per rank (`--world real`: gloo on CPU, NCCL on GPUs) or one worker
for one rank of a fake process group of the full world size (`--world fake`).

Workers start with `forkserver` with torch and the harness preloaded (a forked child of a parent that has run
multi-threaded torch compute can hang; `spawn` re-imports torch per rank, 5-15 s). `MEMCALC_VALIDATE_START=fork`
selects fork (fast when the parent has run no torch compute). Every rank has a deadline; a rank that fails or
times out ends the run, and the others are terminated.
"""

from __future__ import annotations

import os
import queue as _queue
import socket
import time
import traceback
from typing import Any

from memcalc.specs import Run

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "torch.distributed.pipelining", "memcalc.validate.harness"]


class RankFailure(Exception):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(run: Run, rank: int, world_size: int, device: str, steps: int, warmup: int, fake: bool,
            port: int, q: Any, seq_lengths: tuple[int, ...] | None = None) -> None:
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        if fake:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        else:
            backend = "nccl" if device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size)
        from memcalc.validate.harness import run_rank

        result = run_rank(run, rank, world_size, device, steps, warmup, fake, seq_lengths)
        q.put((rank, "ok", result))
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        import multiprocessing as mp

        method = os.environ.get("MEMCALC_VALIDATE_START", "forkserver")
        _CTX = mp.get_context(method)
        if method == "forkserver":
            _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def run_world(run: Run, *, world: str, device: str, steps: int, warmup: int, ranks: list[int],
              timeout: float, seq_lengths: tuple[int, ...] | None = None) -> dict[int, dict[str, Any]]:
    """Run the configuration; return the measurement of each rank in `ranks` (fake world: each is run in its
    own single-process fake group)."""
    ctx = _context()
    results: dict[int, dict[str, Any]] = {}
    if world == "fake":
        jobs = [[r] for r in ranks]
    else:
        jobs = [list(range(int(run.gpus)))]
    for job in jobs:
        q = ctx.Queue()
        port = _free_port()
        procs = {}
        for r in job:
            p = ctx.Process(target=_worker, args=(run, r, int(run.gpus), device, steps, warmup, world == "fake",
                                                  port, q, seq_lengths), daemon=True)
            p.start()
            procs[r] = p
        deadline = time.monotonic() + timeout
        pending = set(job)
        error = None
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    error = f"rank(s) {sorted(pending)} did not finish within {timeout:.0f} s"
                    break
                try:
                    r, status, payload = q.get(timeout=min(left, 1.0))
                except _queue.Empty:
                    dead = [r for r in pending if not procs[r].is_alive() and procs[r].exitcode not in (None, 0)]
                    if dead:
                        error = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                        break
                    continue
                pending.discard(r)
                if status != "ok":
                    error = f"rank {r} failed: {payload}"
                    break
                results[r] = payload
        finally:
            for p in procs.values():
                p.join(timeout=5 if error is None else 0.5)
            for p in procs.values():
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=2)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=2)
            q.close()
        if error:
            raise RankFailure(error)
    return results


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a torchrun / torch.distributed.run launch (RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_ADDR are set by the launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_torchrun_rank(run: Run, *, device: str, steps: int, warmup: int,
                      seq_lengths: tuple[int, ...] | None = None) -> tuple[int, dict[int, dict[str, Any]]]:
    """Run this process's rank of a torchrun launch (NCCL on GPUs, gloo on CPU) and gather every rank's
    measurement on every rank. Returns (this rank, {rank: measurement})."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != int(run.gpus):
        from memcalc.errors import InputError

        raise InputError(f"torchrun started {world} ranks but the layout has --gpus {run.gpus}; make them agree")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    from memcalc.validate.harness import run_rank

    try:
        mine = run_rank(run, rank, world, device, steps, warmup, False, seq_lengths)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    return rank, {r: m for r, m in enumerate(gathered)}
