#!/usr/bin/env python3
"""PyTorch peer of `ferry-bench attention`: causal scaled_dot_product_attention, forward + backward.

q, k, v and the output gradient are [batch, heads, context, head_dim] fp32 tensors (uniform in
[-1, 1), seeded); one run is o = scaled_dot_product_attention(q, k, v, is_causal=True) then
o.backward(do), with the gradients of q, k and v. Untimed warm-up runs first (at least 3 and
0.3 s), then --repeat rounds of as many runs as fill about 20 ms; ms is the median per run.
--device cpu (default) or cuda[:N] (each round ends with torch.cuda.synchronize(); TF32 off).
Prints one JSON line; on failure to import torch or to open the device, one line with "error" and exit 1.
"""
import argparse
import json
import statistics
import sys
import time

from peer_device import device_arg, open_device, strict_fp32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", type=device_arg, default="cpu")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
        print(json.dumps({"impl": "torch-sdpa", "error": f"cannot import torch: {e}"}))
        return 1
    device, error = open_device(torch, a.device)
    if error:
        print(json.dumps({"impl": "torch-sdpa", "error": error}))
        return 1
    strict_fp32(torch)
    gen = torch.Generator().manual_seed(1)
    shape = (a.batch, a.heads, a.context, a.head_dim)

    def tensor(grad: bool):
        t = (torch.rand(shape, generator=gen) * 2 - 1).to(device)
        return t.requires_grad_(grad)

    q, k, v, do = tensor(True), tensor(True), tensor(True), tensor(False)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run():
        q.grad = k.grad = v.grad = None
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(do)

    warm_runs, t0 = 0, time.perf_counter()
    while warm_runs < 3 or time.perf_counter() - t0 < 0.3:
        run()
        sync()
        warm_runs += 1
    per_run = (time.perf_counter() - t0) / warm_runs
    per_round = max(1, min(1000, int(0.020 / max(per_run, 1e-6))))
    times = []
    for _ in range(a.repeat):
        start = time.perf_counter()
        for _ in range(per_round):
            run()
        sync()
        times.append((time.perf_counter() - start) / per_round * 1e3)
    print(json.dumps({"impl": "torch-sdpa", "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                      "device": str(device), "ms": statistics.median(times)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
