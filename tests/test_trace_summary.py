"""``tools/trace_summary.py``: GPU busy / idle time, gaps and host annotations of a torch-profiler Chrome trace
(a synthetic one whose figures are known)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "trace_summary.py"


@pytest.fixture(scope="module")
def ts():
    return load_script("trace_summary")


def _x(cat, name, ts, dur):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=0)


def _trace():
    """Two steps 200 us apart: a graph launch, kernels A (10 us), B (10 us, 1 us after A: no gap), C (10 us, 4 us
    after B: a small gap), then the host samples (an annotation) while the GPU waits 165 us for the next step."""
    ev = [dict(ph="M", name="process_name", pid=0, args={})]
    for s in range(2):
        o = 200.0 * s
        ev += [_x("user_annotation", "execute_model", o, 95), _x("cuda_runtime", "cudaGraphLaunch", o + 90, 4),
               _x("kernel", "A", o + 100, 10), _x("kernel", "B", o + 111, 10), _x("kernel", "C", o + 125, 10),
               _x("user_annotation", "sample", o + 140, 50), _x("cpu_op", "aten::argmax", o + 150, 5)]
    return ev


def test_summary_splits_busy_small_and_large_gaps(ts):
    r = ts.summarize(_trace())
    assert r["steps"] == 2 and r["graph_launches"] == 2 and r["kernels"] == 6
    assert r["span_us"] == pytest.approx(235.0)  # 100 -> 335
    assert r["busy_us"] == pytest.approx(60.0) and r["kernel_sum_us"] == pytest.approx(60.0)
    assert r["idle_us"] == pytest.approx(175.0)  # 1 + 4 + 165 + 1 + 4
    assert r["gaps"] == 3 and r["small_gap_us"] == pytest.approx(8.0) and r["large_gap_us"] == pytest.approx(165.0)
    assert r["launch_period_us"] == pytest.approx(200.0)
    (t, g, names), = r["large_gaps"]
    assert g == pytest.approx(165.0) and names == ["sample", "aten::argmax", "execute_model"]
    assert [k[0] for k in r["kernel_table"]] and r["kernel_table"][0][1:] == (2, 20.0)
    assert dict((k, (c, t)) for k, c, t in r["host_annotations"]) == {"execute_model": (2, 190.0),
                                                                       "sample": (2, 100.0)}


def test_host_waits_name_the_ops_that_made_the_host_wait(ts):
    """Synchronize calls and long device-to-host copies are listed with the host ops around them (innermost first);
    short copies (host-to-device, queued) and long kernel launches (a host far ahead, blocked on a full queue) are
    not waits."""
    ev = _trace() + [
        _x("cpu_op", "aten::item", 10, 60), _x("cpu_op", "aten::_local_scalar_dense", 11, 58),
        _x("cuda_runtime", "cudaStreamSynchronize", 12, 55),
        _x("cpu_op", "aten::to", 300, 400), _x("cpu_op", "aten::copy_", 301, 398),
        _x("cuda_runtime", "cudaMemcpyAsync", 302, 396),  # a device-to-host read that waited
        _x("cuda_runtime", "cudaMemcpyAsync", 720, 12),  # a queued copy
        _x("cuda_runtime", "cuLaunchKernelEx", 740, 900)]  # a launch blocked on a full queue
    waits = ts.summarize(ev)["host_waits"]
    assert sorted(waits, key=lambda w: -w[0]) == [
        (396.0, "cudaMemcpyAsync", ["aten::copy_", "aten::to"]),
        (55.0, "cudaStreamSynchronize", ["aten::_local_scalar_dense", "aten::item", "execute_model"])]
    text = ts.report(ts.summarize(ev))
    assert "host waits for the GPU" in text and "cudaMemcpyAsync  aten::copy_ < aten::to" in text
    assert "host waits" not in ts.report(ts.summarize(_trace()))


def test_cli_reads_gzip_and_writes_csv(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    out = subprocess.run([sys.executable, str(SCRIPT), str(p), "--csv", str(tmp_path / "k.csv")],
                         capture_output=True, text=True, check=True).stdout
    assert "per step: GPU span 117.5 us" in out and "sample" in out
    rows = (tmp_path / "k.csv").read_text().splitlines()
    assert rows[0] == "kernel,calls_per_step,us_per_step,us_per_call" and len(rows) == 4


def test_python_functions_self_and_inclusive_time(ts):
    """step (100 us) calls prep (30, which calls build 10) and prep again (20); another thread runs out (40);
    a recursive f (outer 50, inner 20) counts its inclusive time once."""
    ev = [_x("python_function", "step", 0, 100), _x("python_function", "prep", 5, 30),
          _x("python_function", "build", 10, 10), _x("python_function", "prep", 50, 20),
          dict(_x("python_function", "out", 0, 40), tid=1),
          _x("python_function", "f", 200, 50), _x("python_function", "f", 210, 20)]
    got = {k: (c, st, inc) for k, c, st, inc in ts.python_functions(ev)}
    assert got["step"] == (1, 50.0, 100.0)
    assert got["prep"] == (2, 40.0, 50.0)
    assert got["build"] == (1, 10.0, 10.0)
    assert got["out"] == (1, 40.0, 40.0)
    assert got["f"] == (2, 50.0, 50.0)
    r = ts.summarize(_trace() + ev)
    assert "python functions by inclusive time" in ts.report(r)


def test_busy_shares_split_overlapping_kernels_and_add_up_to_the_busy_time(ts):
    """Two streams (or a kernel launched early by programmatic dependent launch): the time they overlap is split
    between them, so the shares add up to the busy time; categories group our and upstream's kernel names."""
    ev = [_x("kernel", "_hc_down_kernel", 0, 10), _x("kernel", "_hc_up_kernel", 4, 10),  # overlap 4..10
          _x("kernel", "fused_moe_kernel", 20, 5), _x("kernel", "void vllm::moe::topkGating<16>", 22, 2)]
    res = ts.summarize(ev, steps=1)
    sh = res["busy_share"]
    assert sh["_hc_down_kernel"] == pytest.approx(4 + 3) and sh["_hc_up_kernel"] == pytest.approx(3 + 4)
    assert sh["fused_moe_kernel"] == pytest.approx(4) and sh["void vllm::moe::topkGating<16>"] == pytest.approx(1)
    assert sum(sh.values()) == pytest.approx(res["busy_us"]) == pytest.approx(19)
    cats = {c: b for c, _, b in res["category_table"]}
    assert cats == pytest.approx({"hc": 14, "moe": 5})
    assert ts.category("kernel_cutlass_kernel_vllmmodelsqwen4_expnvidiaopscute_dsl_hc_down_silu") == "hc"
    assert ts.category("void vllm::cooperative::cooperative_topk_cs4<512u>") == "qsa"
    assert "busy us/st" in ts.report(res)


GDN_LAYER = [("router_topk", 2.0), ("experts", 10.0), ("_hc_mix", 3.0), ("causal_conv1d_update", 2.0),
             ("fused_recurrent_gated_delta_rule", 6.0)]
QSA_LAYER = [("router_topk", 2.0), ("experts", 10.0), ("_hc_mix", 3.0), ("_qsa_score_paged_kernel", 4.0),
             ("_qsa_attend_kernel", 5.0), ("_qsa_merge_kernel", 1.0)]


def _layered_trace(steps=3, pattern="GGQG", gap=1.0):
    """``steps`` decode steps of the layers in ``pattern`` (G: GDN, Q: QSA), each step: an embedding, the layers,
    the LM head and the sampler; kernels back to back, ``gap`` us apart."""
    ev, t = [], 0.0
    for _ in range(steps):
        seq = [("embed", 1.0)]
        for c in pattern:
            seq += GDN_LAYER if c == "G" else QSA_LAYER
        seq += [("lm_head_gemv", 20.0), ("sample", 2.0)]
        for name, dur in seq:
            ev.append(_x("kernel", name, t, dur))
            t += dur + gap
        t += 50.0  # the host between steps
    return ev


def test_census_cuts_the_step_into_layers_and_types_them(ts):
    c = ts.census(_layered_trace(), 3, (7, 4))  # (7: no kernel runs 7 times a step: falls back to 4)
    assert c["boundary"] == "router_topk"
    assert c["kernels_per_step"] == pytest.approx(1 + 3 * 5 + 6 + 2)
    # a period runs from one router to the next (here: one layer's own kernels); the last layer's crosses into the
    # next step (LM head, sampler, embedding): a second GDN sequence, left out of the kernel list
    g, q = c["gdn"], c["qsa"]
    assert (g["periods"], g["variants"], q["periods"], q["variants"]) == (8, 2, 3, 1)  # (the trace's last: uncut)
    assert g["kernels"] == 5 and [n for n, _ in g["sequence"]] == [n for n, _ in GDN_LAYER]
    assert g["kernel_us"] == pytest.approx(sum(d for _, d in GDN_LAYER))
    assert g["wall_us"] == pytest.approx(sum(d for _, d in GDN_LAYER) + len(GDN_LAYER) * 1.0)
    assert q["kernels"] == 6 and q["sequence"][4] == ("_qsa_attend_kernel", 5.0)
    assert c["rest_us"] > 0 and "GDN layer" in ts.census_report(c, 1.0, 2e9, 3e12)
    assert "67% of the copy bandwidth" in ts.census_report(c, 1.0, 2e9, 3e12)


def test_census_says_why_without_a_kernel_once_a_layer(ts):
    c = ts.census(_layered_trace(), 3, 5)
    assert "no kernel runs once a layer" in c["error"] and "layer census" in ts.census_report(c)


def test_census_from_the_command_line(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": _layered_trace()}, f)
    out = subprocess.run([sys.executable, str(SCRIPT), str(p), "--steps", "3", "--layers", "4"],
                         capture_output=True, text=True, check=True).stdout
    assert "GDN layer: " in out and "QSA layer: " in out


def test_graph_groups_split_a_step_by_the_graph_that_ran_each_kernel(ts):
    """Kernels carry the correlation id of the host call that issued them (a graph replay's: its launch's): two
    steps of a 3-op graph (two of its kernels overlap: busy counts them once) and a 1-op graph, plus an eager
    kernel a step; and the report's lines for them."""
    ev, cid = [], 0

    def call(name, t):
        nonlocal cid
        cid += 1
        ev.append(dict(_x("cuda_runtime", name, t, 2), args={"correlation": cid}))
        return cid

    def kern(name, t, dur, c):
        ev.append(dict(_x("kernel", name, t, dur), args={"correlation": c}))

    for s in range(2):
        o = 1000.0 * s
        g = call("cudaGraphLaunch", o)
        kern("A", o + 10, 10, g), kern("B", o + 15, 10, g), kern("C", o + 30, 5, g)  # busy 15 + 5, span 25
        g = call("cudaGraphLaunch", o + 40)
        kern("D", o + 50, 7, g)
        kern("E", o + 70, 3, call("cudaLaunchKernel", o + 60))
    graphs, eager = ts.graph_groups(ev)
    assert graphs == [(3, 2, 20.0, 25.0), (1, 2, 7.0, 7.0)]
    assert eager == (2, 6.0)
    r = ts.summarize(ev, steps=2)
    text = ts.report(r)
    assert "     3        2      20.0      25.0" in text and "GPU ops outside graphs: 1.0 a step, busy 3.0 us" in text
