#!/usr/bin/env bash
# plan_accuracy.sh: how close `ferry plan`'s predicted step is to the step `ferry train` then takes,
# with the GEMM rate measured at the step's own products (what `ferry plan` does) and with the rate
# of one 1024^3 product (what it did before; given here as --gemm-gflops), on the same device.
#
# usage: bash bench/plan_accuracy.sh [FERRY] [FERRY_BENCH]
#   FERRY, FERRY_BENCH  the binaries (default build/release/ferry, build/release/ferry-bench)
# PLAN_ACCURACY_MODELS: the runs to make, by name (default: all of them below, in order).
# Prints the square's rate, then per run one line: the prediction with the square's rate, the
# prediction with the step's (its rate, groups probed of the step's, the FLOP share probed, the batch
# probed), the step's nodes in their order at those rates (scheduled_step_ms, with the compute lane's
# idle time: on a GPU the prediction is at least that), the measured step_ms, and each prediction
# over the measurement; where the step moves bytes over the link, the link's rates (to the device,
# back, both at once) and each direction's transfer time alone and both together (link_ms).
set -uo pipefail
ferry=${1:-build/release/ferry}
bench=${2:-build/release/ferry-bench}
for b in "$ferry" "$bench"; do
  [ -x "$b" ] || { echo "plan_accuracy: no executable $b (build the release preset first)" >&2; exit 2; }
done

# name | plan arguments | the training run's own arguments (steps or samples: enough for steady steps)
runs=(
  "mlp|--model mlp|--epochs 1 --train-limit 16384"
  "cnn|--model cnn|--epochs 1 --train-limit 8192"
  "gpt|--model gpt|--steps 24 --eval-every 24 --val-windows 4"
  "deep64|--model deep --device-budget 64MiB|--epochs 1 --train-limit 8192"
  "gpt512-stream|--model gpt --width 512 --depth 8 --heads 8 --context 64 --batch 4 --residency stream --device-budget 128MiB|--steps 16 --eval-every 16 --val-windows 4"
  "gpt85m|--model gpt --width 768 --depth 12 --heads 12 --context 256 --batch 8|--steps 4 --eval-every 4 --val-windows 2"
)
only=" ${PLAN_ACCURACY_MODELS:-} "

square=$("$bench" --repeat 5 gemm --impls ferry --sizes 1024 2>/dev/null |
  python3 -c 'import json, sys; print(max(json.loads(l)["gflops_best"] for l in sys.stdin if l.startswith("{")))')
[ -n "$square" ] || { echo "plan_accuracy: ferry-bench gemm printed no rate" >&2; exit 1; }
echo "1024^3 product: $square GFLOPS"
for run in "${runs[@]}"; do
  IFS='|' read -r name plan train <<<"$run"
  [ "$only" = "  " ] || [[ $only == *" $name "* ]] || continue
  # shellcheck disable=SC2086  # the argument lists are words
  step=$("$ferry" plan $plan --json 2>/dev/null)
  # shellcheck disable=SC2086
  square_plan=$("$ferry" plan $plan --gemm-gflops "$square" --json 2>/dev/null)
  # shellcheck disable=SC2086
  trained=$("$ferry" train $plan $train --json --quiet 2>/dev/null)
  python3 - "$name" "$step" "$square_plan" "$trained" <<'EOF'
import json, sys
name, step, square, trained = sys.argv[1], *(json.loads(a) if a.strip() else None for a in sys.argv[2:])
if not (step and square and trained):
    print(f"{name}: a run printed no JSON (plan, plan with the square's rate, train: {bool(step)}, {bool(square)}, {bool(trained)})")
    sys.exit(0)
actual = trained["step_ms"]
print(f'{name}: square {square["predicted_step_ms"]:.1f} ms ({square["predicted_step_ms"] / actual:.2f}x) | '
      f'step products {step["predicted_step_ms"]:.1f} ms ({step["predicted_step_ms"] / actual:.2f}x; '
      f'{step["gemm_gflops"]:.1f} GFLOPS, {step["gemm_products_probed"]} of {step["gemm_products"]} kinds, '
      f'{100 * step["gemm_probed_flops_share"]:.0f}% of FLOPs, batch {step["gemm_probe_batch"]}) | '
      f'in order {step["scheduled_step_ms"]:.1f} ms, compute idle {step["scheduled_compute_idle_ms"]:.1f} | '
      f'measured {actual:.1f} ms' +
      (f' | link {step["link_gbps"]:.1f} GB/s there, {step["link_d2h_gbps"]:.1f} back, {step["link_both_gbps"]:.1f} '
       f'both at once: transfers {step["to_device_ms"]:.1f} + {step["to_host_ms"]:.1f} ms alone, '
       f'{step["transfer_ms"]:.1f} together' if step["transfer_ms"] else ''))
EOF
done
