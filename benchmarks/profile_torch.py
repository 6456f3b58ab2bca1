"""Where a torch training step spends its time: torch.profiler's top operators for one adapter mode.

Builds the torch adapter exactly as the worker does (``TorchBackend``, shared initial weights,
synthetic data), trains one warm-up epoch, then profiles one more and prints the operators by
self CPU time, and how much of the step is convolution and matmul (where the FLOPs are) against
everything else (pooling, ReLU, dropout, the optimizer, layout copies). This explains an MFU:
the FLOP-heavy kernels run at their own rate, and the rest adds time without FLOPs.

    python benchmarks/profile_torch.py --mode channels_last --batch-size 128
    python benchmarks/profile_torch.py --mode eager --precision bf16 --batch-size 32 --limit 2048

This is a figure, not a test.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend import results  # noqa: E402
from benchbackend.data import datasets as data  # noqa: E402
from benchbackend.spec import model, workload  # noqa: E402

GEMM_OPS = ("conv", "mm", "addmm", "matmul", "linear", "bmm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--mode", default="channels_last", help="eager, channels_last, compile")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit", type=int, default=4096, help="training samples in the profiled epoch")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchbackend.backends.torch.adapter import TorchBackend

    w = workload.load(args.workload).with_overrides(limit=args.limit, epochs=2, batch_size=args.batch_size)
    ds = data.load(w, "synthetic")
    orders = data.epoch_orders(len(ds.y_train), 2, w.seed)
    b = TorchBackend(w, "cpu", args.mode, args.precision, {})
    b.build(model.initial_weights(w))
    b.set_data(data.normalize(ds.x_train), ds.y_train)
    t0 = time.perf_counter()
    b.to_host(b.train_epoch(orders[0]))
    b.sync()
    warm = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        b.to_host(b.train_epoch(orders[1]))
        b.sync()
        wall = time.perf_counter() - t0
    n = len(ds.y_train)
    flops = results.TRAIN_FLOPS_FACTOR * model.flops_per_sample(w) * n
    print(f"torch {torch.__version__} {args.mode}@{args.precision}, batch {args.batch_size}, {n} samples, "
          f"{torch.get_num_threads()} threads")
    print(f"warm-up epoch {warm:.2f} s; profiled epoch {wall:.2f} s = {n / wall:.0f} samples/s, "
          f"{flops / wall / 1e9:.0f} GFLOP/s (the profiler adds a little)")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if any(k in e.key.lower() for k in GEMM_OPS))
    if gemm:  # self CPU time is the calling thread's wall time: intra-op threads run inside the op
        share = gemm / total
        print(f"convolution/matmul kernels: {100 * share:.0f}% of the operators' time, at about "
              f"{flops / (wall * share) / 1e9:.0f} GFLOP/s while they run; the other {100 * (1 - share):.0f}% "
              f"does no counted FLOPs")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48))


if __name__ == "__main__":
    main()
