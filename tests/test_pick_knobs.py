"""``recipes/pick_knobs.py``: the QSA decode settings an unattended lease takes from bench_ops' stage table."""

import csv

from recipe_loader import load_recipe

pk = load_recipe("pick_knobs")

DEFAULTS = dict(ATTN_SLOT_BLOCK=32, ATTN_WARPS=8, ATTN_STAGES=1, ATTN_PREFETCH=False, ATTN_SLOT_BLOCK_MANY=16,
                ATTN_WARPS_MANY=2, ATTN_STAGES_MANY=3, ATTN_PREFETCH_MANY=True, ATTN_PROGRAMS=512, TOPK="triton")


def _table(tmp_path, rows):
    p = tmp_path / "ops_stages.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "case", "stage", "us"])
        w.writerows(("qsa_decode_paged",) + r for r in rows)
        w.writerow(("hc_mix", "T=1", "whole op (defaults)", 1.0))  # other ops' rows are ignored
    return pk.read(str(p))


def test_a_clear_win_is_taken_a_small_or_wrong_one_is_not(tmp_path):
    t = _table(tmp_path, [
        ("B=32", "attention+merge SB=16 warps=2 stages=3 prefetch=True programs=512", 60.0),
        ("B=32", "attention+merge SB=16 warps=1 stages=2 prefetch=True programs=1024 kt=True", 50.0),  # 17% faster
        ("B=32", "attention+merge SB=32 warps=1 stages=2 prefetch=True programs=2048 WRONG", 30.0),
        ("B=1", "attention+merge SB=32 warps=8 stages=1 prefetch=False programs=512", 13.0),
        ("B=1", "attention+merge SB=64 warps=8 stages=2 prefetch=False programs=512", 12.9),  # within the margin
        ("B=32", "whole op (defaults)", 110.0), ("B=32", "whole op (TOPK=vllm)", 100.0),
        ("B=1", "whole op (defaults)", 34.0), ("B=1", "whole op (TOPK=vllm)", 30.0),
    ])
    knobs, why = pk.pick(t, DEFAULTS, vllm_topk_ok=True)
    assert knobs == dict(ATTN_SLOT_BLOCK_MANY=16, ATTN_WARPS_MANY=1, ATTN_STAGES_MANY=2, ATTN_PREFETCH_MANY=1,
                         ATTN_K_T_MANY=1, ATTN_PROGRAMS=1024, TOPK="vllm"), why
    # without a passing kernel test vLLM's select is never taken, however fast
    knobs, why = pk.pick(t, DEFAULTS, vllm_topk_ok=False)
    assert "TOPK" not in knobs and any("not taken" in w for w in why)


def test_vllm_topk_slower_at_batch_1_or_defaults_untimed_keep_the_defaults(tmp_path):
    t = _table(tmp_path, [
        ("B=32", "attention+merge SB=16 warps=1 stages=2 prefetch=True programs=1024", 50.0),  # defaults untimed
        ("B=32", "whole op (defaults)", 110.0), ("B=32", "whole op (TOPK=vllm)", 100.0),
        ("B=1", "whole op (defaults)", 30.0), ("B=1", "whole op (TOPK=vllm)", 34.0),
    ])
    knobs, why = pk.pick(t, DEFAULTS, vllm_topk_ok=True)
    assert knobs == {}, why
    assert any("were not timed" in w for w in why) and any("not faster" in w for w in why)


def test_vllm_select_as_the_default_is_turned_off_when_its_test_fails(tmp_path):
    t = _table(tmp_path, [
        ("B=32", "whole op (defaults)", 100.0), ("B=32", "whole op (TOPK=vllm)", 100.0),
        ("B=32", "whole op (TOPK=triton)", 110.0),
        ("B=1", "whole op (defaults)", 28.0), ("B=1", "whole op (TOPK=vllm)", 28.0),
        ("B=1", "whole op (TOPK=triton)", 33.0),
    ])
    vllm_default = dict(DEFAULTS, TOPK="vllm")
    assert pk.pick(t, vllm_default, vllm_topk_ok=True)[0] == {}  # faster: the default stays, no knob
    assert pk.pick(t, vllm_default, vllm_topk_ok=False)[0] == {"TOPK": "triton"}
    assert pk.pick(t, DEFAULTS, vllm_topk_ok=True)[0] == {"TOPK": "vllm"}  # compared with the Triton select's row


def test_a_breakdown_timed_without_vllm_keeps_the_select_default(tmp_path):
    t = _table(tmp_path, [("B=32", "whole op (defaults)", 100.0), ("B=32", "whole op (TOPK=triton)", 100.0),
                          ("B=1", "whole op (defaults)", 30.0), ("B=1", "whole op (TOPK=triton)", 30.0)])
    assert pk.pick(t, dict(DEFAULTS, TOPK="vllm"), vllm_topk_ok=True)[0] == {}
    assert pk.pick(t, dict(DEFAULTS, TOPK="vllm"), vllm_topk_ok=False)[0] == {"TOPK": "triton"}
    assert pk.pick(t, DEFAULTS, vllm_topk_ok=True)[0] == {}
