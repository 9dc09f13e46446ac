"""Where a decode step's time goes, from a torch-profiler Chrome trace (``benchmarks/bench_vllm_gpu.py --profile``
writes one per implementation): GPU busy time against the wall span of the steps, the idle gaps between kernels
(inside graph replays: launch latency; between them: the host), the host-side annotations vLLM records (schedule,
prepare inputs, sample, ...), and the kernels by total time.

    python tools/trace_summary.py TRACE.json[.gz] [--steps 8] [--csv kernels.csv]

Prints a report (with the GPU time of each captured graph a step replays: the verification and draft graphs under
MTP, and of the ops outside graphs); ``--csv`` also writes the kernel table. ``summarize`` returns the same figures
as a dict.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import statistics
from collections import defaultdict

GAP_US = 2.0  # idle time between two kernels counted as a gap from this length on
HOST_GAP_US = 20.0  # gaps from this length on are listed with the host annotations that ran during them
HOST_WAIT_US = 100.0  # a device-to-host copy from this length on counts as the host waiting for the GPU
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
GRAPH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoH_v2")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


# kernel name fragments -> mechanism, for the busy-time split by category (ours' and upstream's kernels)
CATEGORIES = (
    ("moe", ("fused_moe", "topkGating", "moe_align", "moe_sum", "count_and_sort", "act_and_mul")),
    ("hc", ("_hc_", "hc_down_sil")),
    ("qsa", ("_qsa_", "cooperative_topk", "persistent_topk", "_index_update", "_norm_rope", "gather_block_tables")),
    ("gdn", ("gated_delta_rule", "causal_conv1d", "layer_norm_fwd")),
    ("ple", ("_ple", "ngram", "lookup_ple", "grouped_gemma_rmsnorm")),
    ("gemm", ("nvjet", "cublas", "splitKreduce", "gemv", "dot_kernel", "gemm")),
    ("sampling", ("sample", "argmax", "combine_sampled")),
)


def category(name: str) -> str:
    for cat, frags in CATEGORIES:
        if any(f in name for f in frags):
            return cat
    return "other"


def busy_shares(gpu: list[dict]) -> dict:
    """{kernel name: busy us}: every moment the GPU is busy is split evenly between the kernels running then (two
    streams, or a kernel launched early by programmatic dependent launch and waiting): the shares add up to the
    busy time, unlike the kernels' durations."""
    edges = []
    for e in gpu:
        s, d = float(e["ts"]), float(e["dur"])
        edges.append((s, 1, e["name"]))
        edges.append((s + d, -1, e["name"]))
    edges.sort(key=lambda x: (x[0], x[1]))
    active: dict = defaultdict(int)  # kernel name -> running instances (only names with some)
    out: dict = defaultdict(float)
    n, last = 0, None
    for t, kind, name in edges:
        if n and t > last:
            for k, c in active.items():
                out[k] += (t - last) * c / n
        active[name] += kind
        if not active[name]:
            del active[name]
        n += kind
        last = t
    return out


def _spans(events: list[dict]) -> list[dict]:
    """The trace's complete events (``ph`` X) with a start and a duration."""
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _gpu_ops(spans: list[dict]) -> list[dict]:
    """GPU work: kernels, memcpys and memsets."""
    return [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def summarize(events: list[dict], steps: int = 0) -> dict:
    """Figures of the trace's GPU kernels (cat "kernel"; memcpy / memset count as GPU work too) and host
    annotations. ``steps``: divide per-step figures by this (0: by the number of CUDA graph launches, else 1)."""
    xs = _spans(events)
    gpu = _gpu_ops(xs)
    launches = [e for e in xs if e.get("cat") == "cuda_runtime" and e.get("name") in GRAPH_CALLS]
    n = steps or len(launches) or 1
    res: dict = dict(steps=n, graph_launches=len(launches), kernels=len(gpu))
    by = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by[e["name"]][0] += 1
        by[e["name"]][1] += float(e["dur"])
    res["kernel_table"] = sorted(((k, c, t) for k, (c, t) in by.items()), key=lambda r: -r[2])
    shares = busy_shares(gpu)
    res["busy_share"] = dict(shares)
    cats: dict = defaultdict(lambda: [0.0, 0.0])
    for k, (c, t) in by.items():
        cats[category(k)][0] += t
        cats[category(k)][1] += shares.get(k, 0.0)
    res["category_table"] = sorted(((k, t, b) for k, (t, b) in cats.items()), key=lambda r: -r[2])
    if gpu:
        busy = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
        span = busy[-1][1] - busy[0][0]
        busy_us = sum(e - s for s, e in busy)
        gaps = [(busy[i][1], busy[i + 1][0] - busy[i][1]) for i in range(len(busy) - 1)]
        gaps = [(t, g) for t, g in gaps if g >= GAP_US]
        res.update(span_us=span, busy_us=busy_us, kernel_sum_us=sum(float(e["dur"]) for e in gpu),
                   idle_us=span - busy_us, gaps=len(gaps), gap_us=sum(g for _, g in gaps),
                   small_gap_us=sum(g for _, g in gaps if g < HOST_GAP_US),
                   large_gap_us=sum(g for _, g in gaps if g >= HOST_GAP_US))
        host = [e for e in xs if e.get("cat") in ("user_annotation", "cpu_op", "python_function")]
        big = sorted((gg for gg in gaps if gg[1] >= HOST_GAP_US), key=lambda gg: -gg[1])[:12]
        listed = []
        for t, g in big:  # the host annotations that ran while the GPU was idle, in the order they began
            on = [e for e in host if float(e["ts"]) < t + g and float(e["ts"]) + float(e["dur"]) > t]
            on.sort(key=lambda e: float(e["ts"]))
            names = []
            for e in on:
                if e["name"] not in names:
                    names.append(e["name"])
            listed.append((t - busy[0][0], g, names[:6]))
        res["large_gaps"] = listed
        if len(launches) > 1:
            ts = sorted(float(e["ts"]) for e in launches)
            res["launch_period_us"] = statistics.median(b - a for a, b in zip(ts, ts[1:]))
    res["graphs"], res["eager"] = graph_groups(xs)
    ann = defaultdict(lambda: [0, 0.0])
    for e in xs:
        if e.get("cat") == "user_annotation":
            ann[e["name"]][0] += 1
            ann[e["name"]][1] += float(e["dur"])
    res["host_annotations"] = sorted(((k, c, t) for k, (c, t) in ann.items()), key=lambda r: -r[2])
    res["host_functions"] = python_functions(xs)
    res["host_waits"] = host_waits(xs)
    return res


def graph_groups(events: list[dict]) -> tuple[list[tuple[int, int, float, float]], tuple[int, float]]:
    """The GPU ops grouped by the host call that issued them (the profiler gives a graph replay's kernels the
    correlation id of its ``cudaGraphLaunch``): per captured graph, taken as the launches with the same number of
    GPU ops, (ops, launches, median busy us, median span us), in the order first seen; and the ops outside graphs
    (count, busy us). Busy: the union of the ops' intervals (ops that overlap count once). With MTP a step replays
    several graphs (the verification, the drafts), so this shows where a step's GPU time goes graph by graph."""
    xs = _spans(events)
    calls = {e["args"]["correlation"]: e["name"] for e in xs
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    per_launch: dict = defaultdict(list)
    eager: list[tuple[float, float]] = []
    for e in _gpu_ops(xs):
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        c = e.get("args", {}).get("correlation")
        if calls.get(c) in GRAPH_CALLS:
            per_launch[c].append(iv)
        else:
            eager.append(iv)
    shapes: dict = {}
    for ivs in sorted(per_launch.values(), key=lambda v: min(s for s, _ in v)):
        u = _union(ivs)
        shapes.setdefault(len(ivs), []).append((sum(b - a for a, b in u), u[-1][1] - u[0][0]))
    graphs = [(k, len(v), statistics.median(b for b, _ in v), statistics.median(sp for _, sp in v))
              for k, v in shapes.items()]
    return graphs, (len(eager), sum(b - a for a, b in _union(eager)))


def host_waits(xs: list[dict]) -> list[tuple[float, str, list[str]]]:
    """Where the host waited for the GPU: synchronize calls, and copies long enough to be device-to-host reads that
    waited for the queue to drain (``HOST_WAIT_US``): (wait us, call, the host ops around it, innermost first).
    A wait empties the GPU's queue of work the host had prepared ahead, so an eager step then runs as fast as its
    host can launch. Long kernel launches are not waits: the host blocks there because it is far ahead."""
    calls = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and (e.get("name") in SYNC_CALLS or (e.get("name") in COPY_CALLS and float(e["dur"]) >= HOST_WAIT_US))]
    if not calls:
        return []
    ops = defaultdict(list)
    for e in xs:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for c in calls:
        t0, t1 = float(c["ts"]), float(c["ts"]) + float(c["dur"])
        around = [e for e in ops[(c.get("pid"), c.get("tid"))]
                  if float(e["ts"]) <= t0 and float(e["ts"]) + float(e["dur"]) >= t1]
        around.sort(key=lambda e: float(e["dur"]))
        out.append((float(c["dur"]), c["name"], [e["name"] for e in around]))
    return out


def python_functions(xs: list[dict]) -> list[tuple[str, int, float, float]]:
    """Host time by Python function (the profiler's ``python_function`` events, recorded with
    ``with_stack=True``): (name, calls, self us, inclusive us), by self time. Self time = the event's duration less
    its direct children's on the same thread; inclusive time counts a function once where it is nested in itself."""
    by = defaultdict(lambda: [0, 0.0, 0.0])
    threads = defaultdict(list)
    for e in xs:
        if e.get("cat") == "python_function":
            threads[(e.get("pid"), e.get("tid"))].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [end, name, children's time, start]
        for e in evs:
            t0, d = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= t0:
                end, name, child, start = stack.pop()
                by[name][1] += (end - start) - child
            nested = any(f[1] == e["name"] for f in stack)
            if stack:
                stack[-1][2] += d
            by[e["name"]][0] += 1
            if not nested:
                by[e["name"]][2] += d
            stack.append([t0 + d, e["name"], 0.0, t0])
        while stack:
            end, name, child, start = stack.pop()
            by[name][1] += (end - start) - child
    return sorted(((k, c, st, inc) for k, (c, st, inc) in by.items()), key=lambda r: -r[2])


def report(res: dict, top: int = 30) -> str:
    n = res["steps"]
    lines = [f"steps {n} (graph launches {res['graph_launches']}), GPU ops {res['kernels']} "
             f"({res['kernels'] / n:.0f} per step)"]
    if "span_us" in res:
        lines.append(
            f"per step: GPU span {res['span_us'] / n:.1f} us = busy {res['busy_us'] / n:.1f} us (kernel sum "
            f"{res['kernel_sum_us'] / n:.1f}) + idle {res['idle_us'] / n:.1f} us, of which gaps under "
            f"{HOST_GAP_US:.0f} us {res['small_gap_us'] / n:.1f} us (launch latency inside graphs) and from "
            f"{HOST_GAP_US:.0f} us on {res['large_gap_us'] / n:.1f} us (waiting for the host); "
            f"{res['gaps'] / n:.0f} gaps of >= {GAP_US:.0f} us a step")
        if "launch_period_us" in res:
            lines.append(f"median period between graph launches: {res['launch_period_us']:.1f} us")
        lines.append("largest idle gaps (start after the first kernel, length, host annotations during the gap):")
        for t, g, names in res["large_gaps"]:
            lines.append(f"  +{t / 1e3:9.3f} ms  {g:8.1f} us  {', '.join(names) or '-'}")
    if res.get("graphs"):
        lines.append("CUDA graphs (GPU ops grouped by the launch that ran them; launches of equal op count taken as "
                     "one graph; medians over its launches):")
        lines.append(f"  {'ops':>6s} {'launches':>8s} {'busy us':>9s} {'span us':>9s}")
        for k, c, b, sp in res["graphs"]:
            lines.append(f"  {k:6d} {c:8d} {b:9.1f} {sp:9.1f}")
    if res.get("eager") and res["eager"][0]:
        k, b = res["eager"]
        lines.append(f"GPU ops outside graphs: {k / n:.1f} a step, busy {b / n:.1f} us a step")
    waits = res.get("host_waits") or []
    if waits:
        lines.append(f"host waits for the GPU (synchronizes, device-to-host copies >= {HOST_WAIT_US:.0f} us): "
                     f"{len(waits) / n:.1f} a step, {sum(w for w, _, _ in waits) / n / 1e3:.2f} ms a step; the "
                     f"longest (wait, call, host ops around it, innermost first):")
        for w, call, names in sorted(waits, key=lambda x: -x[0])[:8]:
            lines.append(f"  {w:10.1f} us  {call}  {' < '.join(names[:4]) or '-'}")
    lines.append(f"{'kernel':70s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s} {'busy us/st':>10s}")
    shares = res.get("busy_share", {})
    for name, c, t in res["kernel_table"][:top]:
        lines.append(f"{name[:70]:70s} {c / n:10.1f} {t / n:9.1f} {t / c:8.2f} {shares.get(name, 0.0) / n:10.1f}")
    if res.get("category_table"):
        lines.append(f"{'category (busy us/step: overlapping kernels share the time)':70s} {'kernels':>10s} "
                     f"{'us/step':>9s} {'':>8s} {'busy us/st':>10s}")
        for cat, t, b in res["category_table"]:
            lines.append(f"{cat:70s} {'':>10s} {t / n:9.1f} {'':>8s} {b / n:10.1f}")
    if res["host_annotations"]:
        lines.append(f"{'host annotation':70s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s}")
        for name, c, t in res["host_annotations"][:top]:
            lines.append(f"{name[:70]:70s} {c / n:10.1f} {t / n:9.1f} {t / c:8.2f}")
    if res.get("host_functions"):
        for what, key in (("self", 2), ("inclusive", 3)):
            lines.append(f"{'python functions by ' + what + ' time (host; with_stack traces)':70s} "
                         f"{'calls/step':>10s} {'self us/st':>10s} {'incl us/st':>10s}")
            for name, c, st, inc in sorted(res["host_functions"], key=lambda r: -r[key])[:top]:
                lines.append(f"{name[-70:]:70s} {c / n:10.1f} {st / n:10.1f} {inc / n:10.1f}")
    return "\n".join(lines)


# -- the per-layer census (issue 50, item 1) -------------------------------------------------------------------------
# A decode step replays the decoder layers' kernels in program order. A kernel that runs once in every decoder layer
# (the MoE router's top-k, say) cuts the kernel sequence into one period a layer; a period holding a GDN kernel is a
# GDN layer's, one holding a QSA kernel a QSA layer's (the cut falls inside a layer: a period is one layer's tail and
# the next one's head, the same count and time as a whole layer). What falls outside the periods (embedding, final
# mixer, LM head, sampler, the first layer's head, the last one's tail) and periods that cross steps are "rest".
GDN_KERNELS = ("gated_delta_rule", "delta_rule", "causal_conv1d", "_gdn", "gdn_", "recurrent")
QSA_KERNELS = ("_qsa_", "qsa_", "sparse_paged", "_index_update")


def layer_type(names) -> str:
    gdn = any(any(f in n for f in GDN_KERNELS) for n in names)
    qsa = any(any(f in n for f in QSA_KERNELS) for n in names)
    return "gdn" if gdn and not qsa else "qsa" if qsa and not gdn else "rest"


def census(events: list[dict], steps: int, layers_per_step) -> dict:
    """Kernels and GPU time per GDN layer and per QSA layer of ``steps`` profiled steps that each run
    ``layers_per_step`` decoder layers (an int, or candidates, e.g. (27, 24): the target's layers + MTP draft runs,
    then the target's alone). Returns {boundary, per type: layers, kernels (per layer, the commonest sequence),
    kernel_us and wall_us (medians a layer), periods (how many), sequence [(name, median us)]}, rest_us a step,
    kernels_per_step}; or
    {error: why} when no kernel runs exactly once a layer."""
    gpu = sorted(_gpu_ops(_spans(events)), key=lambda e: float(e["ts"]))
    counts: dict = defaultdict(int)
    for e in gpu:
        counts[e["name"]] += 1
    want = (layers_per_step,) if isinstance(layers_per_step, int) else tuple(layers_per_step)
    boundary = None
    for per in want:
        cands = [n for n, c in counts.items() if c == per * steps and layer_type([n]) == "rest"]
        if cands:  # the first in program order: the cut sits at the same place in every layer
            first = {n: i for i, n in reversed(list(enumerate(e["name"] for e in gpu)))}
            boundary = min(cands, key=lambda n: first[n])
            break
    if boundary is None:
        return dict(error=f"no kernel runs once a layer (want {' or '.join(str(w * steps) for w in want)} calls "
                          f"in {steps} steps)", kernels_per_step=len(gpu) / max(steps, 1))
    cuts = [i for i, e in enumerate(gpu) if e["name"] == boundary]
    periods: dict = defaultdict(list)
    in_layers = 0.0
    for a, b in zip(cuts, cuts[1:]):
        seg = gpu[a:b]
        kind = layer_type([e["name"] for e in seg])
        if kind == "rest":
            continue
        wall = float(gpu[b]["ts"]) - float(seg[0]["ts"])
        periods[kind].append((tuple(e["name"] for e in seg), [float(e["dur"]) for e in seg], wall))
    out: dict = dict(boundary=boundary, kernels_per_step=len(gpu) / steps)
    for kind, segs in periods.items():
        seqs: dict = defaultdict(list)
        for names, durs, wall in segs:
            seqs[names].append((durs, wall))
        names, runs = max(seqs.items(), key=lambda kv: len(kv[1]))  # the commonest sequence (a layer's own kernels)
        med = [statistics.median(d[i] for d, _ in runs) for i in range(len(names))]
        out[kind] = dict(periods=len(segs), kernels=len(names), variants=len(seqs),
                         kernel_us=statistics.median(sum(d) for _, d, _ in segs),
                         wall_us=statistics.median(w for _, _, w in segs), sequence=list(zip(names, med)))
        in_layers += sum(w for _, _, w in segs)
    if gpu:
        out["span_us"] = (float(gpu[-1]["ts"]) + float(gpu[-1]["dur"]) - float(gpu[0]["ts"])) / steps
        out["rest_us"] = out["span_us"] - in_layers / steps
    return out


def census_report(c: dict, step_ms: float | None = None, step_bytes: float | None = None,
                  bandwidth: float | None = None) -> str:
    """The census as text; with the step time (ms), the bytes a step must read and the copy bandwidth (B/s), the
    achieved bandwidth and its fraction."""
    if "error" in c:
        return f"layer census: {c['error']}; {c['kernels_per_step']:.0f} GPU ops a step"
    lines = [f"layer census (cut at {c['boundary'][:60]}): {c['kernels_per_step']:.0f} GPU ops a step"]
    for kind in ("gdn", "qsa"):
        if kind in c:
            k = c[kind]
            lines.append(f"  {kind.upper()} layer: {k['kernels']} kernels, kernel sum "
                         f"{k['kernel_us']:.1f} us, wall {k['wall_us']:.1f} us (medians of {k['periods']} periods; "
                         f"{k['variants']} kernel sequences, the commonest listed)")
            lines += [f"    {i:2d} {n[:80]:80s} {u:8.2f}" for i, (n, u) in enumerate(k["sequence"])]
    if "rest_us" in c:
        lines.append(f"  rest of the step (embedding, head, sampler, edges): {c['rest_us']:.1f} us of a "
                     f"{c['span_us']:.1f} us GPU span")
    if step_ms and step_bytes and bandwidth:
        got = step_bytes / (step_ms * 1e-3)
        lines.append(f"  bytes a step {step_bytes / 1e9:.3f} GB in {step_ms:.3f} ms: {got / 1e12:.2f} TB/s = "
                     f"{100 * got / bandwidth:.0f}% of the copy bandwidth ({bandwidth / 1e12:.2f} TB/s)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=0, help="steps in the trace (default: its CUDA graph launches)")
    ap.add_argument("--csv", help="write the kernel table here")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--layers", default="", help="decoder layers a step runs (comma list of candidates, e.g. 27,24 "
                    "for 24 layers + 3 MTP draft runs): print the per-layer census too (needs --steps)")
    a = ap.parse_args()
    events = load(a.trace)
    res = summarize(events, a.steps)
    print(report(res, a.top))
    if a.layers:
        print(census_report(census(events, a.steps or res["steps"], [int(x) for x in a.layers.split(",")])))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "calls_per_step", "us_per_step", "us_per_call"])
            for name, c, t in res["kernel_table"]:
                w.writerow([name, c / res["steps"], t / res["steps"], t / c])


if __name__ == "__main__":
    main()
