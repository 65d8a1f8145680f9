#!/usr/bin/env python3
"""PyTorch peer of `ferry train --model gpt`: the same character-level GPT on the fortunes corpus, on the CPU or a GPU.

Corpus: every regular file directly in --corpus-dir (default: $FERRY_TEXT_DIR when set, else
/usr/share/games/fortunes, as ferry) (symlinks followed, de-duplicated by resolved real path), names
ending in .dat or .u8 or starting with a dot skipped, sorted by resolved real path as bytes and
concatenated as raw bytes. Vocabulary: the distinct byte values, ascending (token id = index). The first
floor(0.9 * n) bytes train, the tail validates.

Model: token embedding [V, W] + learned position embedding [context, W]; `depth` pre-LayerNorm blocks
x += Wo(attn(LN1(x))), x += fc2(GELU(fc1(LN2(x)))) (fc1 W->4W, fc2 4W->W, exact erf GELU); causal attention
with `heads` heads, separate q/k/v linears W->W, scores scaled by 1/sqrt(W/heads); final LayerNorm then a
linear head W->V (no weight tying). Every Linear has a bias, LayerNorm eps is 1e-5, no dropout, fp32.
Loss: mean cross-entropy over all batch*context positions. Adam (0.9, 0.999, eps 1e-8), constant lr.

Training batches are `batch` windows of context+1 bytes at uniformly random offsets in the train split.
val_loss is the mean cross-entropy (nats per character) over every position of non-overlapping windows of
the validation split starting at 0, context, 2*context, ... (start + context + 1 <= len(val)), at most
--val-windows of them, picked as windows[i * len(windows) // N] for i in range(N).

Modes: eager, compile (torch.compile of the model, default backend; at least 3 warm-up steps first, timed
apart and reported as compile_s; --warmup untimed steps in either mode), or both (eager then compile, each from the same seed). Train for --seconds of
wall time or --steps steps, in blocks of --block-steps steps (the last one shorter when --steps is not a
multiple) timed with one synchronisation each, at the block's end, where its losses are read (they stay on
the device until then; --seconds and --eval-every are checked at block ends). tokens_per_s counts the timed
steps only, over their total time (evaluation excluded); step_ms is the median over the blocks of the
block's mean step time, the statistic ferry-bench gpt reports for ferry, and block_ms every block's mean.
--device cpu (the default) or cuda (cuda:N for another GPU): the model, the token ids and the optimizer state
live there (the random window offsets are still drawn on the CPU from the seeded generator, so both devices
train on the same batches); on cuda every timed region (a block of training steps, an evaluation, the compile
warm-up) starts and ends with torch.cuda.synchronize(), and TF32 matmuls are turned off (fp32 as ferry). Each JSON line
names the device ("device", plus "device_name" on cuda).
Prints one JSON line per mode on stdout; on failure to import torch, or --device cuda where torch has no usable
CUDA device, one JSON line with "error" and exit 1.
"""
import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time

from peer_device import device_arg, open_device, strict_fp32

CORPUS_DIR = "/usr/share/games/fortunes"
COMPILE_WARMUP_STEPS = 3


def device_fields(torch, device) -> dict:
    """The JSON fields naming the device a mode ran on."""
    fields = {"device": str(device)}
    if device.type == "cuda":
        fields["device_name"] = torch.cuda.get_device_name(device)
        fields["tf32"] = False
    return fields


def load_corpus(directory: str) -> bytes:
    """The fortunes corpus as ferry reads it (see the module docstring)."""
    paths = {}
    for name in os.listdir(directory):
        if name.endswith(".dat") or name.endswith(".u8") or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        if not os.path.isfile(path):  # follows symlinks
            continue
        real = os.path.realpath(path)
        paths[os.fsencode(real)] = real
    data = bytearray()
    for key in sorted(paths):
        with open(paths[key], "rb") as f:
            data += f.read()
    return bytes(data)


def val_window_starts(n_val: int, context: int, cap: int) -> list:
    starts = list(range(0, n_val - context, context))  # start + context + 1 <= n_val
    if cap > 0 and len(starts) > cap:
        starts = [starts[i * len(starts) // cap] for i in range(cap)]
    return starts


def build_model(torch, nn, F, vocab: int, width: int, depth: int, heads: int, context: int):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width, eps=1e-5)
            self.q = nn.Linear(width, width)
            self.k = nn.Linear(width, width)
            self.v = nn.Linear(width, width)
            self.o = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width, eps=1e-5)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, w = x.shape
            hd = w // heads
            h = self.ln1(x)
            q = self.q(h).view(b, t, heads, hd).transpose(1, 2)
            k = self.k(h).view(b, t, heads, hd).transpose(1, 2)
            v = self.v(h).view(b, t, heads, hd).transpose(1, 2)
            # Default scale of scaled_dot_product_attention is 1/sqrt(head_dim) = 1/sqrt(W/heads).
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, w))
            x = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="none"))
            return x

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(context, width)
            self.blocks = nn.ModuleList([Block() for _ in range(depth)])
            self.ln_f = nn.LayerNorm(width, eps=1e-5)
            self.head = nn.Linear(width, vocab)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos.weight[:t]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def run_mode(torch, nn, F, args, mode: str, data: dict, device) -> dict:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)  # on the CPU: the same batches on every device
    vocab = data["vocab"]
    ctx = args.context
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # Built on the CPU from the seed (the same initial weights on every device), then moved, before
    # the optimizer, whose state follows the parameters.
    model = build_model(torch, nn, F, vocab, args.width, args.depth, args.heads, ctx).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    train_ids = data["train"]
    val_ids = data["val"]
    n_train = train_ids.numel()
    span = torch.arange(ctx + 1)

    def batch():
        offs = torch.randint(0, n_train - ctx, (args.batch,), generator=gen)
        w = train_ids[(offs[:, None] + span).to(device)]
        return w[:, :-1], w[:, 1:]

    fwd = model
    if mode == "compile":
        fwd = torch.compile(model)

    def step():
        """One step; its loss stays on the device (reading it would wait for the step)."""
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        logits = fwd(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    starts = val_window_starts(val_ids.numel(), ctx, args.val_windows)
    val_windows = torch.stack([val_ids[s : s + ctx + 1] for s in starts]) if starts else None

    def evaluate() -> float:
        # Evaluated with the eager module (same parameters) so eval batch shapes never recompile.
        if val_windows is None:
            return float("nan")
        total = 0.0
        count = 0
        model.eval()
        with torch.no_grad():
            for i in range(0, val_windows.shape[0], args.batch):
                w = val_windows[i : i + args.batch]
                logits = model(w[:, :-1])
                total += F.cross_entropy(logits.reshape(-1, vocab), w[:, 1:].reshape(-1), reduction="sum").item()
                count += w.shape[0] * ctx
        model.train()
        return total / count

    result = {"peer": f"torch-{mode}", **device_fields(torch, device)}
    updates = 0
    warmup = max(args.warmup, COMPILE_WARMUP_STEPS) if mode == "compile" else args.warmup
    if warmup:
        # Untimed steps first (one-off allocation and, compiled, the compile itself).
        sync()
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
            updates += 1
        sync()
        if mode == "compile":
            result["compile_s"] = time.perf_counter() - t0
        result["warmup_steps"] = warmup

    curve = []
    losses = []
    block_ms = []
    train_s = 0.0
    eval_s = 0.0
    steps = 0
    next_eval = args.eval_every if args.eval_every else None
    if next_eval:
        sync()
        t0 = time.perf_counter()
        curve.append({"seconds": 0.0, "step": updates, "val_loss": evaluate()})
        sync()
        eval_s += time.perf_counter() - t0
    while True:
        if args.steps is not None and steps >= args.steps:
            break
        if args.steps is None and train_s >= args.seconds:
            break
        # A block of steps with one wait, at its end, where its losses are read.
        n = args.block_steps if args.steps is None else min(args.block_steps, args.steps - steps)
        sync()
        t0 = time.perf_counter()
        block = [step() for _ in range(n)]
        sync()
        elapsed = time.perf_counter() - t0
        losses += torch.stack(block).tolist()
        train_s += elapsed
        block_ms.append(elapsed * 1e3 / n)
        steps += n
        updates += n
        if next_eval and train_s >= next_eval:
            sync()
            t0 = time.perf_counter()
            curve.append({"seconds": train_s, "step": updates, "val_loss": evaluate()})
            sync()
            eval_s += time.perf_counter() - t0
            while next_eval <= train_s:
                next_eval += args.eval_every
    if curve and curve[-1]["step"] == updates:
        val_loss = curve[-1]["val_loss"]  # the last periodic evaluation already saw the final weights
    else:
        sync()
        t0 = time.perf_counter()
        val_loss = evaluate()
        sync()
        eval_s += time.perf_counter() - t0
        curve.append({"seconds": train_s, "step": updates, "val_loss": val_loss})

    tail = losses[-20:]
    result.update(
        {
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "width": args.width,
            "depth": args.depth,
            "heads": args.heads,
            "context": ctx,
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "parameters": params,
            "vocab": vocab,
            "corpus_bytes": data["corpus_bytes"],
            "corpus_sha256": data["corpus_sha256"],
            "train_bytes": n_train,
            "val_bytes": val_ids.numel(),
            "val_windows": len(starts),
            "steps": steps,
            "block_steps": args.block_steps,
            "seconds": train_s,
            "eval_s": eval_s,
            "block_ms": block_ms,
            "step_ms": statistics.median(block_ms) if block_ms else 0.0,
            "tokens_per_s": args.batch * ctx * steps / train_s if train_s > 0 else 0.0,
            "train_loss": sum(tail) / len(tail) if tail else float("nan"),
            "val_loss": val_loss,
            "curve": curve,
        }
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("eager", "compile", "both"), default="eager")
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps first (compile mode: at least 3)")
    ap.add_argument("--seconds", type=float, default=None, help="train for this many seconds of wall time")
    ap.add_argument("--steps", type=int, default=None, help="train for this many (timed) steps")
    ap.add_argument("--block-steps", type=int, default=10,
                    help="timed steps per block: one synchronisation at each block's end (--seconds, --eval-every "
                         "and the clock are checked there)")
    ap.add_argument("--eval-every", type=float, default=None, help="also evaluate every this many training seconds")
    ap.add_argument("--val-windows", type=int, default=256, help="cap on validation windows (0: all)")
    ap.add_argument("--corpus-dir", default=os.environ.get("FERRY_TEXT_DIR") or CORPUS_DIR,
                    help="folder of text files (default: $FERRY_TEXT_DIR, else %(default)s)")
    ap.add_argument("--device", type=device_arg, default="cpu",
                    help="cpu (default), cuda or cuda:N: where the model, data and optimizer live")
    args = ap.parse_args()
    if args.seconds is None and args.steps is None:
        args.seconds = 60.0
    if args.block_steps < 1:
        ap.error("--block-steps must be at least 1")
    if args.width % args.heads:
        ap.error("--width must be a multiple of --heads")
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn
    except Exception as e:  # no torch, or a broken install
        print(json.dumps({"error": f"cannot import torch: {e}", "python": sys.executable, "device": args.device}))
        return 1
    device, problem = open_device(torch, args.device)
    if problem:
        print(problem, file=sys.stderr)
        print(json.dumps({"error": problem, "python": sys.executable, "device": args.device,
                          "torch_version": torch.__version__}))
        return 1
    if device.type == "cuda":
        strict_fp32(torch)

    torch.set_num_threads(os.cpu_count() or 1)
    try:
        corpus = load_corpus(args.corpus_dir)
    except OSError as e:
        print(json.dumps({"error": f"cannot read corpus {args.corpus_dir}: {e}"}))
        return 1
    if len(corpus) < 2 * (args.context + 1):
        print(json.dumps({"error": f"corpus too small: {len(corpus)} bytes"}))
        return 1
    symbols = sorted(set(corpus))
    lut = torch.zeros(256, dtype=torch.long)
    lut[torch.tensor(symbols, dtype=torch.long)] = torch.arange(len(symbols))
    ids = lut[torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()]
    n_train = len(corpus) * 9 // 10  # exact floor(0.9 * n), no float rounding
    data = {
        "vocab": len(symbols),
        "train": ids[:n_train].to(device),
        "val": ids[n_train:].to(device),
        "corpus_bytes": len(corpus),
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
    }

    modes = ("eager", "compile") if args.mode == "both" else (args.mode,)
    rc = 0
    for mode in modes:
        try:
            result = run_mode(torch, nn, F, args, mode, data, device)
        except Exception as e:  # e.g. torch.compile without a working C++ toolchain
            result = {"peer": f"torch-{mode}", "torch_version": torch.__version__, "error": f"{type(e).__name__}: {e}",
                      **device_fields(torch, device)}
            rc = 1
        print(json.dumps(result), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
