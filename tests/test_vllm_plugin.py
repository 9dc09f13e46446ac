"""Plugin registration (idempotent, opt-out) and load-time checkpoint validation."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

_PROBE = """
import qwen4exp.vllm as plugin
from vllm.plugins import load_general_plugins
load_general_plugins()
a = plugin.register(); b = plugin.register()
from vllm import ModelRegistry
m = ModelRegistry.models
print(a, b, m["Qwen4ExpForCausalLM"].module_name, m["Qwen4ExpForConditionalGeneration"].module_name)
"""


def _probe(env_extra):
    env = dict(os.environ, **env_extra)
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1].split()


def test_register_idempotent_and_replaces_in_tree():
    a, b, m1, m2 = _probe({})
    assert (a, b) == ("True", "True")
    assert m1 == m2 == "qwen4exp.vllm.model"


_HOOK = """
import types
import qwen4exp.vllm as plugin
plugin.register(); plugin._install_config_hooks()  # twice: chained once
import vllm.model_executor.models.config as mc
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
hook = mc.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"]
assert hook._qwen4exp_hook and not getattr(hook._base, "_qwen4exp_hook", False), hook
calls = []
hook._base = type("B", (), {"verify_and_update_config": staticmethod(lambda c: calls.append(c))})
out = []
for gpu, width, spec in ((True, 128, None), (True, 64, None), (True, 128, object()), (False, 128, None)):
    current_platform.is_cuda_alike = lambda gpu=gpu: gpu
    text = types.SimpleNamespace(linear_key_head_dim=width, linear_value_head_dim=width)
    for mode in (None, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                 CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
                                    model_config=types.SimpleNamespace(hf_text_config=text), speculative_config=spec)
        hook.verify_and_update_config(cfg)
        m = cfg.compilation_config.cudagraph_mode
        out.append(m.name if m is not None else "None")
print(len(calls), " ".join(out))
"""


def test_gpu_graph_mode_hook_chains_vllm_hook_and_picks_modes():
    """On GPUs the config hook keeps FULL graphs for pure decode where our code is capturable (vLLM's GDN on
    128-wide heads): default/FULL -> FULL_AND_PIECEWISE, also under speculative decoding (MTP verifications and
    draft steps are sync-free, equal-query batches; vLLM runs draft decode steps only in FULL graphs); with our GDN
    (64-wide heads) every FULL* mode -> PIECEWISE; NONE and PIECEWISE stay; nothing changes on CPU; vLLM's own
    hook still runs."""
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", _HOOK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    n, *modes = p.stdout.strip().splitlines()[-1].split()
    assert n == "24"
    fp, pw = "FULL_AND_PIECEWISE", "PIECEWISE"
    assert modes[:6] == [fp, fp, fp, "FULL_DECODE_ONLY", pw, "NONE"]  # capturable decode
    assert modes[6:12] == [pw, pw, pw, pw, pw, "NONE"]  # our GDN
    assert modes[12:18] == [fp, fp, fp, "FULL_DECODE_ONLY", pw, "NONE"]  # speculative decoding: as without
    assert modes[18:] == ["None", fp, "FULL", "FULL_DECODE_ONLY", pw, "NONE"]  # CPU: untouched


def test_opt_out_keeps_vllm_classes():
    a, b, m1, m2 = _probe({"QWEN4EXP_VLLM": "0"})
    assert (a, b) == ("False", "False")
    assert m1.startswith("vllm.") and m2.startswith("vllm.")


def _broken_checkpoint(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind", ["missing", "misshaped"])
def test_bad_checkpoint_fails_with_tensor_name(tiny_ckpt, tmp_path, kind):
    from vllm_offline import run_offline

    name = "model.layers.1.self_attn.indexer.index_qk_proj.weight"
    if kind == "missing":
        edit = lambda sd: sd.pop(name)  # noqa: E731
    else:
        edit = lambda sd: sd.__setitem__(name, torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1]))  # noqa: E731
    ck = _broken_checkpoint(tiny_ckpt, str(tmp_path / "ck"), edit)
    spec = dict(model=ck, prompts=[[2, 3]], engine=dict(dtype="bfloat16", enforce_eager=True,
                                                         skip_tokenizer_init=True, max_model_len=128),
                sampling=dict(max_tokens=1))
    with pytest.raises(RuntimeError) as e:
        run_offline(spec, str(tmp_path / "run"))
    msg = str(e.value)
    assert name in msg
    assert ("missing" in msg) if kind == "missing" else ("has shape" in msg)


_GUARD = """
import os, types
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
from qwen4exp.vllm.layers import check_cudagraph_mode
current_platform.is_cuda_alike = lambda: True
def cfg(mode, eager=False):
    return types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
                                 model_config=types.SimpleNamespace(enforce_eager=eager))
res = []
for mode, eager in ((CUDAGraphMode.PIECEWISE, False), (CUDAGraphMode.NONE, False), (CUDAGraphMode.PIECEWISE, True)):
    try:
        check_cudagraph_mode(cfg(mode, eager)); res.append("ok")
    except ValueError as e:
        res.append("refused:" + ("VLLM_USE_BREAKABLE_CUDAGRAPH" in str(e) and "--enforce-eager" in str(e)) * "named")
print(" ".join(res))
"""


def test_cuda_graphs_without_breakable_graphs_are_refused_with_a_message():
    """On a GPU with breakable CUDA graphs switched off, graph capture would record our eager segments' host syncs:
    the model refuses at build time, naming the variable and the way out; eager or NONE mode is fine."""
    p = subprocess.run([sys.executable, "-c", _GUARD], env=dict(os.environ), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "refused:named ok ok"




_SWIGLU = """
import socket, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
cfg = VllmConfig()
with set_current_vllm_config(cfg):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
from qwen4exp.vllm.layers import MergedSwiGLU
from qwen4exp.vllm.weights import _SWIGLU_MERGED
torch.manual_seed(0)
with set_current_vllm_config(cfg):
    m = MergedSwiGLU(64, 48, "x").to(torch.bfloat16)
ck = {"gate_proj": torch.randn(48, 64), "up_proj": torch.randn(48, 64), "down_proj": torch.randn(64, 48) / 8}
w = m.gate_up_proj.weight
for leaf, half in _SWIGLU_MERGED.items():
    w.weight_loader(w, ck[leaf].to(torch.bfloat16), half)
halves = torch.equal(w.data[:48], ck["gate_proj"].bfloat16()) and torch.equal(w.data[48:], ck["up_proj"].bfloat16())
m.down_proj.weight.data.copy_(ck["down_proj"])
for lin in (m.gate_up_proj, m.down_proj):  # as vLLM's loader does (on CPU: its packed GEMM)
    lin.quant_method.process_weights_after_loading(lin)
x = torch.randn(5, 64, dtype=torch.bfloat16)
with set_current_vllm_config(cfg):
    y = m(x).float()
q = {k: v.bfloat16().float() for k, v in ck.items()}
xf = x.float()
want = (torch.nn.functional.silu(xf @ q["gate_proj"].T) * (xf @ q["up_proj"].T)) @ q["down_proj"].T
print(halves, w.shape[0], round(float((y - want).norm() / want.norm()), 4))
"""


def test_merged_shared_expert_equals_reference_swiglu():
    """The shared expert's gate and up as one GEMM (``MergedSwiGLU``): the checkpoint's gate_proj / up_proj land in
    the right halves (a swap would fail), and after vLLM's post-load processing the output is the SwiGLU of the
    fp32 reference up to bf16 rounding."""
    p = subprocess.run([sys.executable, "-c", _SWIGLU], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    halves, rows, err = p.stdout.strip().splitlines()[-1].split()
    assert halves == "True" and rows == "96"
    assert float(err) < 2e-2, err


def test_hc_down_and_inject_weights_colocated_for_one_gemm():
    """``colocate_projections``: each mixer's W_down and W_inj become the two row ranges of one buffer (so the
    many-token GPU path runs one GEMM), same values, same output; a loader's in-place copy into either parameter
    lands in that buffer; the final mixer (no W_inj) is left alone."""
    from qwen4exp import presets
    from qwen4exp.layers.hyper_connection import HyperConnection
    from qwen4exp.ops.hyper_connection import adjacent_rows
    from qwen4exp.modeling import colocate_projections

    cfg = presets.tiny_text()
    torch.manual_seed(0)
    mods = torch.nn.ModuleList([HyperConnection(cfg), HyperConnection(cfg), HyperConnection(cfg, inject=False)])
    H = torch.randn(5, cfg.hc_count * cfg.hidden_size)
    before = [m(H) for m in mods]
    assert adjacent_rows(mods[0].input_mix_weight_down.weight, mods[0].block_inject_weight.weight) is None
    assert colocate_projections(mods) == 2
    for m, (x0, c0) in zip(mods, before):
        x, c = m(H)
        assert torch.equal(x, x0) and (c is None) == (c0 is None) and (c is None or torch.equal(c, c0))
    wd, wi = mods[0].input_mix_weight_down.weight, mods[0].block_inject_weight.weight
    both = adjacent_rows(wd, wi)
    assert both is not None and torch.equal(both, torch.cat([wd, wi]))
    rows = wd.shape[0] + wi.shape[0]  # zero rows pad the buffer to a multiple of 8 (aligned GEMM output rows)
    padded = adjacent_rows(wd, wi, pad=8)
    assert padded.shape[0] == -(-rows // 8) * 8 and not padded[rows:].any()
    wi.data.copy_(torch.full_like(wi, 3.0))  # (what a weight loader does)
    assert torch.equal(both[wd.shape[0]:], torch.full_like(wi, 3.0))
    assert adjacent_rows(wd, mods[1].block_inject_weight.weight) is None  # another mixer's rows: not adjacent


def test_qsa_projections_colocated_for_one_gemm():
    """``colocate_projections`` on a QSA layer: q, k, v and the indexer's projection become row ranges of one
    (8-row padded) buffer, ``project`` then runs ONE GEMM and splits it (column slices, normed as strided heads):
    the same projections as the four separate GEMMs; a weight whose rows are elsewhere falls back to four."""
    from qwen4exp import presets
    from qwen4exp.layers.linear import linear_weight
    from qwen4exp.ops.layout import stacked_weight
    from qwen4exp.layers.qsa import QSAAttention
    from qwen4exp.layers.rope import RotaryEmbedding
    from qwen4exp.modeling import colocate_projections

    cfg = presets.tiny_text()
    torch.manual_seed(1)
    attn = QSAAttention(cfg)
    mods = (attn.q_proj, attn.k_proj, attn.v_proj, attn.indexer.index_qk_proj)
    for m in mods:
        m.weight.data.normal_(0, 0.2)
    x = torch.randn(7, cfg.hidden_size)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(7), x.dtype)
    assert stacked_weight([linear_weight(m) for m in mods]) is None
    before = attn.project(x, cos, sin)
    assert colocate_projections(attn) == 1
    w = stacked_weight([linear_weight(m) for m in mods], pad=8)
    rows = sum(m.weight.shape[0] for m in mods)
    assert w is not None and w.shape[0] == -(-rows // 8) * 8
    assert torch.equal(w[:rows], torch.cat([m.weight for m in mods]))
    after = attn.project(x, cos, sin)
    for f in ("q", "gate", "k", "v", "index_q", "index_k_raw"):
        torch.testing.assert_close(getattr(after, f), getattr(before, f), rtol=1e-5, atol=1e-5, msg=f)
    attn.v_proj.weight.data = attn.v_proj.weight.data.clone()  # (rows elsewhere: the four GEMMs again)
    assert stacked_weight([linear_weight(m) for m in mods]) is None
    torch.testing.assert_close(attn.project(x, cos, sin).v, before.v, rtol=1e-5, atol=1e-5)


def test_qsa_cache_backend_lean_where_flash_attention(monkeypatch):
    """Where vLLM picks FlashAttention for the QSA cache layer, it gets a subclass whose builder asks for no FA3
    scheduler metadata (no FlashAttention kernel reads that cache); any other choice (this CPU machine's backend)
    stays. (The former ``QWEN4EXP_QSA_METADATA=vllm`` switch is gone: setting it changes nothing.)"""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from qwen4exp.vllm import qsa

    class OtherBackend:  # (any backend vLLM may pick that is not FlashAttention's)
        pass

    lean = qsa.qsa_cache_backend(FlashAttentionBackend)
    assert lean is not FlashAttentionBackend and issubclass(lean, FlashAttentionBackend)
    assert AttentionBackendEnum[lean.get_name()] == AttentionBackendEnum.FLASH_ATTN  # the same registered name
    assert issubclass(lean.get_builder_cls(), FlashAttentionMetadataBuilder)
    assert lean.get_builder_cls() is not FlashAttentionMetadataBuilder
    assert lean.get_impl_cls() is FlashAttentionBackend.get_impl_cls()
    assert qsa.qsa_cache_backend(OtherBackend) is OtherBackend
    monkeypatch.setenv("QWEN4EXP_QSA_METADATA", "vllm")
    assert qsa.qsa_cache_backend(FlashAttentionBackend) is lean


def _common_md(qlens, seq_lens, prefilling=None, host=True):
    import types
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return types.SimpleNamespace(
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32) if host else None,
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32) if host else None,
        is_prefilling=None if prefilling is None else torch.tensor(prefilling))


def test_host_lengths_of_only_where_vllms_host_copies_are_exact():
    """An eager QSA step takes its lengths from vLLM's host copies (no device read, so its host is not held behind
    the GPU) exactly where they are exact: always without speculative decoding; with it only when no request of the
    step decodes or verifies (vLLM's host length of such a row assumes every draft was accepted)."""
    from qwen4exp.vllm.qsa import host_lengths_of

    chunk = _common_md([16384, 848], [16384, 50000])
    assert host_lengths_of(chunk, 0) == ([0, 16384, 17232], [16384, 50000])
    assert host_lengths_of(chunk, 4) == ([0, 16384, 17232], [16384, 50000])  # chunks only: exact under MTP too
    mixed = _common_md([4, 848, 0], [901, 50000, 0])  # a verification beside a chunk, and a padding request
    assert host_lengths_of(mixed, 0) == ([0, 4, 852, 852], [901, 50000, 0])
    assert host_lengths_of(mixed, 4) is None  # the verification's length may run ahead: read the device's
    assert host_lengths_of(_common_md([3, 848], [3, 50000], prefilling=[True, True]), 4) is not None  # a short
    # prompt chunk, told apart from a verification by vLLM's is_prefilling
    assert host_lengths_of(_common_md([3, 848], [3, 50000], prefilling=[False, True]), 4) is None
    assert host_lengths_of(_common_md([5], [9], host=False), 0) is None  # (a vLLM without the host copies)


def test_lean_qsa_builder_hands_its_host_lengths_to_the_layers(monkeypatch):
    """The lean FlashAttention builder of the QSA cache layer puts ``host_lengths_of`` on the metadata it builds,
    with the verification size of the engine's speculative config, and the layers read those instead of the device
    tensors."""
    import types

    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder

    from qwen4exp.vllm import qsa

    def fake_init(self, kv_cache_spec, layer_names, vllm_config, device):
        self.vllm_config = vllm_config

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "__init__", fake_init)
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "build", lambda self, cpl, cm, fast_build=False:
                        types.SimpleNamespace(query_start_loc=None, seq_lens=None))
    builder_cls = qsa.qsa_cache_backend(FlashAttentionBackend).get_builder_cls()
    mtp = builder_cls(None, [], types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        num_speculative_tokens=3)), None)
    plain = builder_cls(None, [], types.SimpleNamespace(speculative_config=None), None)
    assert (mtp.max_decode_queries, plain.max_decode_queries) == (4, 0)
    mixed = _common_md([4, 848], [901, 50000])
    assert mtp.build(0, mixed).qwen4exp_host_lengths is None
    md = plain.build(0, mixed)
    assert md.qwen4exp_host_lengths == ([0, 4, 852], [901, 50000])
    assert qsa._host_lengths(md) == ([0, 4, 852], [901, 50000])  # (its device tensors, None here, never read)


@pytest.fixture
def fresh_envs():
    from qwen4exp import envs
    envs.reset()
    yield envs
    envs.reset()


def test_qsa_host_lengths_switch(monkeypatch, fresh_envs):
    """``QWEN4EXP_QSA_HOST_LENGTHS``: device reads the device tensors even where the builder kept host lengths (the
    former way, for A/B runs); check reads both and fails the step, naming both, where they differ."""
    import types

    from qwen4exp.vllm import qsa

    monkeypatch.setattr(qsa, "_once_per_forward", lambda name, m, key, compute: compute())
    md = types.SimpleNamespace(query_start_loc=torch.tensor([0, 4, 852]), seq_lens=torch.tensor([901, 50000]),
                               qwen4exp_host_lengths=([0, 4, 852], [901, 50000]))
    for how in ("vllm", "device", "check"):
        monkeypatch.setenv("QWEN4EXP_QSA_HOST_LENGTHS", how)
        fresh_envs.reset()
        assert qsa._host_lengths(md) == ([0, 4, 852], [901, 50000])
    md.qwen4exp_host_lengths = ([0, 4, 852], [904, 50000])  # (an optimistic verification length)
    with pytest.raises(RuntimeError, match=r"host lengths .*904.* differ from the device's .*901"):
        qsa._host_lengths(md)
    monkeypatch.setenv("QWEN4EXP_QSA_HOST_LENGTHS", "device")
    fresh_envs.reset()
    assert qsa._host_lengths(md) == ([0, 4, 852], [901, 50000])


def test_eager_steps_keep_every_raw_key_a_later_step_may_read():
    """After any eager step, whatever its requests' MTP verifications accept, the rings hold the raw keys of every
    position of each request's open block that the step wrote (the next step reads them to complete the block).
    A verification completing a block with drafts that are then rejected leaves that block open: before
    ``ring_rows_of_step`` kept every verification row, the step kept only the rows past its last block start, and
    a block completed by a rejected draft later read a raw key that was never written."""
    from qwen4exp.vllm.qsa import BATCHED_MAX_QUERIES, ring_rows_of_step

    r = 4
    # requests: (position of the step's first row, queries): verifications of 4 at every offset in a block,
    # a decode, a short chunk, a long chunk ending mid-block and one ending on a block boundary
    reqs = [(a, 4) for a in range(8, 12)] + [(13, 1), (21, 6), (30, 40), (28, 36)]
    qsl, seq_lens = [0], []
    for a, q in reqs:
        qsl.append(qsl[-1] + q)
        seq_lens.append(a + q)
    kept = set(ring_rows_of_step(qsl, seq_lens, r))
    for b, (a, q) in enumerate(reqs):
        accepted = range(1, q + 1) if q <= BATCHED_MAX_QUERIES else [q]  # (a chunk accepts all its tokens)
        for c in accepted:
            end = a + c  # the request's length after the step
            for p in range(max(a, end // r * r), end):  # this step's positions of the block left open
                assert qsl[b] + p - a in kept, (reqs[b], c, p)
    assert len(kept) < qsl[-1] - 40  # (a long chunk keeps only its open block's rows)


def _block_plan_by_blocks(qsl, seq_lens, r, n):
    """``block_plan``'s contract one block at a time (as it was written before it went array-wise): source rows,
    first position, last row, earlier positions' requests and positions; first rows and requests per block."""
    prev_owner, prev_pos, src, first, last, first_rows, block_owner = [], [], [], [], [], [], []
    for b in range(len(seq_lens)):
        s, e = qsl[b], qsl[b + 1]
        start = seq_lens[b] - (e - s)
        base = start // r * r
        nfull = (seq_lens[b] - base) // r if e > s else 0
        for j in range(nfull):
            for p in range(base + j * r, base + j * r + r):  # the block's r positions: this step's row or earlier
                if p >= start:
                    src.append(s + p - start)
                else:
                    src.append(n + len(prev_pos))
                    prev_owner.append(b)
                    prev_pos.append(p)
            first.append(base + j * r)
            last.append(s + base + j * r + r - 1 - start)
            first_rows.append(s + base + j * r - start if base + j * r >= start else -1)
            block_owner.append(b)
    return src, first, last, prev_owner, prev_pos, first_rows, block_owner


def test_block_plan_matches_a_per_block_loop():
    """The blocks a step completes (``block_plan``, array-wise per request) against a loop over blocks and
    positions, on random steps of decodes, verifications and chunks at several block sizes; None when no block
    completes."""
    import random

    import torch

    from qwen4exp.vllm.qsa import block_plan

    rng = random.Random(0)
    seen = 0
    for _ in range(1500):
        r = rng.choice([1, 2, 4, 8])
        qsl, seq_lens = [0], []
        for _ in range(rng.randint(1, 5)):
            q = rng.choice([0, 1, 2, 4, 5, rng.randint(0, 70)])
            qsl.append(qsl[-1] + q)
            seq_lens.append(rng.randint(0, 50) + q)
        want = _block_plan_by_blocks(qsl, seq_lens, r, qsl[-1])
        got = block_plan(qsl, seq_lens, r, qsl[-1], torch.device("cpu"))
        if not want[1]:
            assert got is None, (qsl, seq_lens, r)
            continue
        seen += 1
        for t, w in zip(got[:5], want[:5]):
            assert t.dtype == torch.long and t.tolist() == w, (qsl, seq_lens, r)
        assert [list(x) for x in got[5]] == [want[1], want[5], want[6]], (qsl, seq_lens, r)
    assert seen > 1000
