"""A helper rank of `comm.CommGroup`, run as its own interpreter: `python -m embshard.bench.comm_rank ...`.

Why a `-m` subprocess and not multiprocessing: `spawn` re-imports the parent's entry script, which under an
Airflow task is the `airflow` command itself (it then dies on the task supervisor's sealed database URL). This
module imports nothing but torch, so a rank starts fast in any host process.
"""
from __future__ import annotations

import argparse


def run_collectives(device: str, cmd_device: str) -> None:
    """Wait for a command (numel, warmup, iters, op) from rank 0, run the collectives (op 0: all-to-all,
    1: all-reduce; comm.OP_*), repeat; numel 0 stops."""
    import torch
    import torch.distributed as dist

    cmd = torch.zeros(4, dtype=torch.int64, device=cmd_device)
    while True:
        dist.broadcast(cmd, src=0)
        numel, warmup, iters, op = (int(x) for x in cmd.tolist())
        if numel == 0:
            return
        x = torch.ones(numel, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        for _ in range(warmup + iters):
            if op == 1:
                dist.all_reduce(x)
            else:
                dist.all_to_all_single(y, x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embshard.bench.comm_rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout-s", type=float, default=120.0)
    a = p.parse_args(argv)

    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = f"cuda:{a.rank}" if a.device != "cpu" else "cpu"
    if dev != "cpu":
        torch.cuda.set_device(a.rank)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout_s))
    try:
        run_collectives(dev, dev)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
