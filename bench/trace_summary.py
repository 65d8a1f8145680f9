#!/usr/bin/env python3
"""Where a traced step's time goes, from a `ferry train --trace FILE` (or ferry-bench) Chrome trace.

usage: python3 bench/trace_summary.py TRACE.json [--step N]

Per step (or the one --step names) and lane (compute, copy in, copy out, host, host unpack,
host thread): the step's span, the lane's busy time and share of the span, its node count, its
three longest spans (an enqueue that blocked in the driver shows on `host thread`), and
for lanes that move bytes the rate they moved them at while busy (bytes of the nodes' tensors over
their durations: for copies and unpack/pack, what was copied); for the compute lane, its time per
kind of node (by_kind: the name without its numbers, e.g. linear.grad_input); for host lanes, their
nodes' waits (waits: waited_ms from ready to start, dispatch_ms from the driver's report that the
commands a node waits for were done to its start) and the time they were busy while the compute lane
was too (busy_with_compute_ms: host updates overlapped with the forward). Then the longest idle stretches of
the compute lane, each with what the other lanes were doing just before it ended (the node on
each lane whose end is the latest before the compute lane resumed) and, in traces that name each
node's last dependency (`after`), the chain of nodes that held it (`held_by`): the waits a
streamed step pays. Standard library only; reads the layout docs/outputs.md describes.
"""
import argparse
import collections
import json
import re
import sys


def load(path):
    with open(path) as f:
        trace = json.load(f)
    lanes = {}
    spans = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lanes[e["tid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            spans.append(e)
    return lanes, spans


def summarize(lanes, spans, step):
    steps = [s for s in spans if lanes.get(s["tid"]) == "steps"]
    marker = next((s for s in steps if s.get("args", {}).get("step") == step), None)
    mine = [s for s in spans if s.get("args", {}).get("step") == step and lanes.get(s["tid"]) != "steps"]
    if not mine:
        return None
    t0 = marker["ts"] if marker else min(s["ts"] for s in mine)
    t1 = marker["ts"] + marker["dur"] if marker else max(s["ts"] + s["dur"] for s in mine)
    span = max(t1 - t0, 1e-9)
    out = {"step": step, "span_ms": span / 1e3, "lanes": {}}
    by_lane = collections.defaultdict(list)
    for s in mine:
        by_lane[lanes.get(s["tid"], str(s["tid"]))].append(s)
    for name, ss in sorted(by_lane.items()):
        busy = union_length([(s["ts"], s["ts"] + s["dur"]) for s in ss])
        moved = sum(s.get("args", {}).get("bytes", 0) for s in ss if s.get("args", {}).get("op") in (
            "fetch", "write_back", "unpack", "pack", "upload", "download"))
        lane = {"nodes": len(ss), "busy_ms": busy / 1e3, "busy_share": busy / span}
        # The longest spans: on `host thread`, enqueue calls that blocked in the driver show here.
        longest = sorted(ss, key=lambda s: s["dur"], reverse=True)[:3]
        lane["longest"] = [f'{s["name"]} {s["dur"] / 1e3:.2f} ms' for s in longest]
        if name == "compute":
            lane["by_kind"] = by_kind(ss)
        waits = host_waits(ss)
        if waits:
            lane["waits"] = waits
        if name.startswith("host") and name != "host thread" and by_lane.get("compute"):
            # Host work while the compute lane was busy too (host updates overlapped with the forward).
            lane["busy_with_compute_ms"] = intersection_length(
                [(s["ts"], s["ts"] + s["dur"]) for s in ss],
                [(s["ts"], s["ts"] + s["dur"]) for s in by_lane["compute"]]) / 1e3
        if moved:
            # A copy node's bytes count its input and its output: half of them crossed.
            lane["copied_gb"] = moved / 2 / 1e9
            lane["gbps_while_busy"] = moved / 2 / max(busy, 1e-9) / 1e3
        out["lanes"][name] = lane
    out["compute_gaps"] = compute_gaps(by_lane, t0, t1)
    return out


def host_waits(spans):
    """A host lane's waits (traces since 2026-12-04): `waited_ms`, from when every node before a node
    had been enqueued to its start; `dispatch_ms`, from the driver's report that the device commands
    it waits for were done to its start. Long waits with short dispatches: the device commands or
    the lane's order held it; long dispatches: the report reached a busy or slow host."""
    out = {}
    for key in ("waited_ms", "dispatch_ms"):
        values = sorted(s["args"][key] for s in spans if key in s.get("args", {}))
        if not values:
            continue
        out[key] = {"median": values[len(values) // 2], "p90": values[int(0.9 * (len(values) - 1))],
                    "max": values[-1], "total": sum(values)}
    if out.get("dispatch_ms"):
        slowest = sorted((s for s in spans if "dispatch_ms" in s.get("args", {})),
                         key=lambda s: s["args"]["dispatch_ms"], reverse=True)[:3]
        out["slowest_dispatch"] = [f'{s["name"]} {s["args"]["dispatch_ms"]:.2f} ms' for s in slowest]
    if out.get("waited_ms"):
        longest = sorted((s for s in spans if "waited_ms" in s.get("args", {})),
                         key=lambda s: s["args"]["waited_ms"], reverse=True)[:3]
        out["longest_waits"] = [f'{s["name"]} {s["args"]["waited_ms"]:.2f} ms'
                                + (f' after {s["args"]["after"]}' if "after" in s["args"] else "") for s in longest]
    return out


def by_kind(spans, keep=12):
    """The compute lane's time per kind of node, longest first: a node's name without its numbers
    and step ("linear14 #1" and "linear3 #1" are both "linear"; "linear41.grad_input" is
    "linear.grad_input"), with how many ran and their total and mean milliseconds."""
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for s in spans:
        kind = re.sub(r"\d+", "", s["name"].split(" #")[0])
        kinds[kind][0] += 1
        kinds[kind][1] += s["dur"]
    ranked = sorted(kinds.items(), key=lambda kv: kv[1][1], reverse=True)[:keep]
    return [{"kind": k, "nodes": n, "ms": us / 1e3, "mean_us": us / n} for k, (n, us) in ranked]


def union_length(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def intersection_length(xs, ys):
    """The time covered by both sets of intervals."""
    xs, ys = merged(xs), merged(ys)
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def held_by(span, by_name, lanes_of, since, links=8):
    """The chain of nodes a span waited for (traces since 2026-12-07 name, in `after`, the node each
    one waited for that ended last), followed back while each ended after `since`: the work, lane
    by lane, that held a lane idle from `since` on."""
    chain = []
    while len(chain) < links:
        name = span.get("args", {}).get("after")
        prev = by_name.get(name)
        if prev is None or prev["ts"] + prev["dur"] <= since:
            break
        chain.append(f'{name} ({lanes_of[name]}, {prev["dur"] / 1e3:.2f} ms)')
        span = prev
    return chain


def compute_gaps(by_lane, t0, t1, keep=8):
    compute = sorted(by_lane.get("compute", []), key=lambda s: s["ts"])
    by_name, lanes_of = {}, {}
    for lane, ss in by_lane.items():
        for x in ss:
            by_name[x["name"]] = x
            lanes_of[x["name"]] = lane
    gaps = []
    last_end = t0
    for s in compute:
        if s["ts"] - last_end > 0:
            gaps.append((s["ts"] - last_end, last_end, s["ts"], s["name"], s))
        last_end = max(last_end, s["ts"] + s["dur"])
    if t1 - last_end > 0:
        gaps.append((t1 - last_end, last_end, t1, "(end of step)", None))
    gaps.sort(reverse=True, key=lambda g: g[:4])
    out = []
    for length, a, b, resumed, span in gaps[:keep]:
        before = {}
        for lane, ss in by_lane.items():
            if lane == "compute":
                continue
            ended = [x for x in ss if x["ts"] + x["dur"] <= b + 1]
            if ended:
                x = max(ended, key=lambda x: x["ts"] + x["dur"])
                if x["ts"] + x["dur"] >= a:
                    before[lane] = f'{x["name"]} ({x["dur"] / 1e3:.2f} ms)'
        gap = {"idle_ms": length / 1e3, "from_ms": (a - t0) / 1e3, "resumed_with": resumed,
               "last_before_on_other_lanes": before}
        chain = held_by(span, by_name, lanes_of, a) if span else []
        if chain:
            gap["held_by"] = chain
        out.append(gap)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, help="the step to summarize (default: every step in the file)")
    a = ap.parse_args()
    lanes, spans = load(a.trace)
    steps = sorted({s.get("args", {}).get("step") for s in spans if "step" in s.get("args", {})})
    if a.step is not None:
        if a.step not in steps:
            have = f"steps {steps[0]} to {steps[-1]}" if steps else "no steps"
            print(f"trace_summary.py: {a.trace} has no step {a.step} (it holds {have})", file=sys.stderr)
            return 1
        steps = [a.step]
    if not steps:
        print(f"trace_summary.py: no steps in {a.trace}", file=sys.stderr)
        return 1
    for step in steps:
        r = summarize(lanes, spans, step)
        if r:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
