#!/usr/bin/env python3
"""cuBLAS (or CPU) SGEMM through PyTorch at given shapes: the peer of `ferry-bench gemm --shape`.

Usage: torch_gemm.py --device cuda --shapes 256,1024,784,nt 2048,3072,768,nt 768,3072,2048,tn ...
Each shape is M,N,K[,OP] with OP one of nn (default), nt, tn, tt: C[M,N] = op(A) op(B), A stored
[M,K] or [K,M] (t), B stored [K,N] or [N,K] (t), as ferry's GemmShape. fp32 with TF32 off. Each
figure is the best of 5 rounds of back-to-back products between two synchronisations (device
throughput, as ferry's tuner measures), after a warm-up: set it beside `ferry-bench gemm`'s
gflops_best (its fastest round), not its gflops (the median round). Prints one JSON line per shape:
{"bench": "gemm-peer", "impl": "torch-<device>", "m", "n", "k", "op", "ms", "gflops"}.
"""
import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", required=True)
    a = p.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"bench": "gemm-peer", "error": f"no torch: {e}"}))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for spec in a.shapes:
        parts = spec.split(",")
        m, n, k = (int(x) for x in parts[:3])
        op = parts[3] if len(parts) > 3 else "nn"
        A = torch.rand(k, m, device=dev).t() if op[0] == "t" else torch.rand(m, k, device=dev)
        B = torch.rand(n, k, device=dev).t() if op[1] == "t" else torch.rand(k, n, device=dev)
        C = torch.empty(m, n, device=dev)
        torch.matmul(A, B, out=C)
        sync()
        t0 = time.perf_counter()
        torch.matmul(A, B, out=C)
        sync()
        once = time.perf_counter() - t0
        reps = max(1, min(200, int(0.02 / max(once, 1e-6))))
        best = once
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.matmul(A, B, out=C)
            sync()
            best = min(best, (time.perf_counter() - t0) / reps)
        print(json.dumps({"bench": "gemm-peer", "impl": f"torch-{a.device}", "m": m, "n": n, "k": k, "op": op,
                          "ms": best * 1e3, "gflops": 2.0 * m * n * k / best * 1e-9}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
