#!/usr/bin/env python3
"""PyTorch peer of `ferry-bench step`: one training step of the same MLP or CNN on the CPU or a CUDA GPU.

--model mlp: MLP 784-1024-1024-10 (nn.Linear + ReLU); --model cnn: ferry's models::cnn(),
conv5x5(32)-ReLU-maxpool2-conv5x5(64)-ReLU-maxpool2-fc256-ReLU-fc10 on 1x28x28 (padding 2).
CrossEntropyLoss, Adam (fused=True where this torch has it), fp32, random standardized data.
--mode eager runs the module as is; --mode compile wraps the forward and loss in torch.compile.
Warm-up steps first (--warmup; compile mode at least 3, so torch.compile's compilation is never
timed as a step; the JSON's "warmup_steps" says how many ran), then --repeat blocks of --steps
steps; the step time reported is the median over the blocks of the block's mean step time (the
same statistic ferry-bench reports for ferry). Within a block nothing waits for the device: each
step's loss stays on the device and the block's losses are read once, at its end.
--device cpu (the default) or cuda (cuda:N for another GPU): the model, the data and the optimizer
state live there; on cuda each timed block starts and ends with torch.cuda.synchronize() (the
only waits), and TF32 is turned off (matmuls and cuDNN convolutions), so the step stays fp32 as
ferry's is. The JSON line names the device ("device", plus "device_name" on cuda).
Prints one JSON line on stdout; on failure (no torch, or --device cuda where torch has no usable
CUDA device), one JSON line with "error" and exit 1.

Environment knobs such as OPENBLAS_CORETYPE or OMP_WAIT_POLICY are set by the caller before this
script starts (they must be set before torch is imported); this script only reports them.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

from peer_device import device_arg, open_device, strict_fp32

COMPILE_WARMUP_STEPS = 3  # torch.compile compiles in the first calls: never timed as steps
ENV_KEYS = ("OPENBLAS_CORETYPE", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hidden", type=str, default="1024,1024")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block")
    ap.add_argument("--repeat", type=int, default=5, help="timed blocks")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", type=device_arg, default="cpu",
                    help="cpu (default), cuda or cuda:N: where the model, data and optimizer live")
    args = ap.parse_args()
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    try:
        import torch
        from torch import nn
    except Exception as e:  # no torch, or a broken install
        print(json.dumps({"error": f"cannot import torch: {e}", "python": sys.executable, "env": env,
                          "device": args.device}))
        return 1
    device, problem = open_device(torch, args.device)
    if problem:
        print(problem, file=sys.stderr)
        print(json.dumps({"error": problem, "python": sys.executable, "env": env, "device": args.device,
                          "torch_version": torch.__version__}))
        return 1
    cuda = device.type == "cuda"
    if cuda:
        strict_fp32(torch)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    if args.model == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))
        sample = (1, 28, 28)
    else:
        hidden = [int(h) for h in args.hidden.split(",") if h]
        layers = []
        width = 784
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 10))
        model = nn.Sequential(*layers)
        sample = (784,)
    model = model.to(device)  # before the optimizer, whose state follows the parameters
    loss_fn = nn.CrossEntropyLoss()
    fused = True
    try:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
    except Exception:  # a torch without fused Adam on this device
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        fused = False

    def forward_loss(x, y):
        return loss_fn(model(x), y)

    if args.mode == "compile":
        try:
            forward_loss = torch.compile(forward_loss)
        except Exception as e:
            print(json.dumps({"error": f"torch.compile failed: {e}", "python": sys.executable, "env": env,
                              "device": str(device)}))
            return 1

    # A few distinct batches of standardized random data, cycled.
    batches = [(torch.randn(args.batch, *sample).to(device), torch.randint(0, 10, (args.batch,)).to(device))
               for _ in range(4)]

    def step(i: int):
        """One step; its loss stays on the device (reading it would wait for the step)."""
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    warmup = max(args.warmup, COMPILE_WARMUP_STEPS) if args.mode == "compile" else args.warmup
    for i in range(warmup):
        step(i)
    block_ms = []
    last_loss = 0.0
    for _ in range(args.repeat):
        sync()
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = step(i)
        sync()
        block_ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
        last_loss = loss.item()  # after the block's clock stopped
    step_ms = statistics.median(block_ms)
    # A diverged peer (seen with torch.compile under ATEN_CPU_CAPABILITY=avx2) is no timing to
    # compare against; its loss is also not JSON.
    diverged = not math.isfinite(last_loss)
    print(
        json.dumps(
            {
                **({"error": f"the peer's loss is {last_loss} after its timed steps: a diverged run is not "
                             "compared"} if diverged else {}),
                "impl": f"pytorch-{torch.__version__}",
                "model": args.model,
                "mode": args.mode,
                "fused_adam": fused,
                "torch_version": torch.__version__,
                "python": sys.executable,
                "torch_file": torch.__file__,
                "step_ms": step_ms,
                "samples_per_s": args.batch * 1e3 / step_ms,
                "block_ms": block_ms,
                "warmup_steps": warmup,
                "threads": torch.get_num_threads(),
                "loss": None if diverged else last_loss,
                "env": env,
                "device": str(device),
                **({"device_name": torch.cuda.get_device_name(device), "tf32": False} if cuda else {}),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
