#!/usr/bin/env python3
"""PyTorch's AdamW on the CPU: the peer of `ferry-bench host-optimizer --peer`.

Usage: torch_host_adam.py --elements N --threads 1,2 --repeat 5
One fp32 parameter of N elements with a fixed gradient, updated in place by torch.optim.AdamW
(lr 1e-3, weight decay 0.01, as ferry's run) in its foreach and fused forms (fused where this
PyTorch has it on the CPU), on each thread count (torch.set_num_threads). Each figure is the
median ms of --repeat steps after two warm-up steps. Prints one JSON line per (form, threads):
{"bench": "host-optimizer", "impl": "torch-<form>", "optimizer": "adamw", "elements", "threads", "ms"}.
"""
import argparse
import json
import statistics
import sys
import time


def step_ms(torch, elements, form, repeat):
    param = torch.nn.Parameter(torch.empty(elements).uniform_(-0.05, 0.05))
    param.grad = torch.empty(elements).uniform_(-1e-3, 1e-3)
    kwargs = {"foreach": True} if form == "foreach" else {"fused": True}
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kwargs)
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    if not bool(torch.isfinite(param).all()):
        raise RuntimeError("a weight is not finite")
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--threads", default="1")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"bench": "host-optimizer", "impl": "torch", "error": f"no torch: {e}"}))
        return 2
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for form in ("foreach", "fused"):
            line = {"bench": "host-optimizer", "impl": f"torch-{form}", "optimizer": "adamw",
                    "elements": a.elements, "threads": threads, "torch": torch.__version__}
            try:
                line["ms"] = step_ms(torch, a.elements, form, a.repeat)
            except (RuntimeError, TypeError, ValueError) as e:
                line["error"] = f"{form}: {e}"
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
