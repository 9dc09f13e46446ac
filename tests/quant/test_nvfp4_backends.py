"""vLLM 0.32's NVFP4 MoE backend selection and weight processing for our routed experts on Blackwell (GB300 = SM103,
B200 = SM100) and Hopper (SM90), run on CPU with vLLM's capability checks monkeypatched.

The real GB300 path is NOT run here: no kernel is launched and no GPU is touched. What runs is vLLM's own Python:
``select_nvfp4_moe_backend`` (oracle/nvfp4.py) and every experts class's ``is_supported_config``,
``ModelOptNvFp4FusedMoE`` (construction, ``create_weights``, ``process_weights_after_loading``, the kernel object
build and the experts' scale folding), ``convert_to_nvfp4_moe_kernel_format`` and its FlashInfer / CUTLASS
preparation (w1/w3 reorder, input-scale reduction, TRT-LLM padding, block-scale swizzle) and the plugin's
``fused_experts`` / ``experts_quant`` / ``check_moe_method``, on CPU tensors of the real model's expert shapes
(Qwen3.8-Flash-Next: hidden 2560, expert intermediate 640, 512 experts, top-10; fewer experts where weights exist).

Monkeypatched (``fake_gpu``; everything is undone after each test):

* ``current_platform`` (vLLM's CpuPlatform instance here): ``is_cuda`` / ``is_cuda_alike`` -> True, ``is_cpu`` ->
  False, and the class's ``get_device_capability`` -> the faked SM. ``has_device_capability``,
  ``is_device_capability`` and ``is_device_capability_family`` are classmethods that read
  ``cls.get_device_capability``, so they follow (``test_fake_platform_is_what_vllm_sees`` checks that they do).
* the availability probes where the experts modules look them up (they import them by name):
  ``trtllm_nvfp4_moe.has_flashinfer_trtllm_fused_moe``, ``flashinfer_cutedsl_moe.has_flashinfer_cutedsl_moe_nvfp4``,
  ``flashinfer_cutedsl_batched_moe.has_flashinfer_cutedsl_grouped_gemm_nt_masked``,
  ``flashinfer_cutlass_moe.has_flashinfer_cutlass_fused_moe``, ``fused_humming_moe.has_humming``. Humming's experts
  also ask the humming package for their GEMM type (``humming_gemm_type``, an import of ``humming``): patched at
  that function, with the two values vLLM compares against ("indexed", "grouped_contiguous").
* things a CUDA build answers and this one cannot, each at the nearest level: ``torch.Tensor.cuda`` -> identity
  (``swizzle_blockscale`` ends with ``.cuda()``, a pure device move); ``torch.accelerator.current_device_index`` ->
  0 (TRT-LLM experts' constructor; only used to place SwiGLU clamp tensors, None for our model); the TP rank / world
  size read by vLLM's parameter classes and by ``FusedMoEFactory`` (1 rank, no process group);
  ``flashinfer_fp4_moe.prepare_static_weights_for_trtllm_fp4_moe`` (FlashInfer's TRT-LLM weight shuffle: CUDA ops of
  the flashinfer package) -> a recorder that returns its inputs, so everything around it runs for real
  (``test_trtllm_shuffle_with_flashinfer`` runs the real one where FlashInfer and a GPU exist; skipped here).
* for the plugin's own ``fused_experts`` (``plugin_experts``): its ``get_current_vllm_config`` -> a namespace with the
  checkpoint directory and vLLM's ModelOpt config (vLLM's side keeps a real VllmConfig), and ``check_moe_method`` ->
  a recorder. That check is tested on its own, on the MoERunner vLLM 0.32's factory returns (the method lives on its
  ``routed_experts``: ``test_check_moe_method_accepts_vllm_moe_runner``).

Not covered here: the kernels themselves, FlashInfer's shuffle, Marlin's repack (``torch.ops._C.gptq_marlin_repack``)
and Humming's conversion (the humming package): CUDA code absent from this CPU build.
"""

import importlib
import importlib.util
import json
import types
from contextlib import contextmanager
from enum import Enum

import pytest
import torch

from qwen4exp.quant.errors import QuantConfigError

pytestmark = pytest.mark.vllm

PREFIX = "model.layers.0.mlp.experts"
EXPERTS_MODS = {  # probe name -> the experts module that imports it
    "trtllm": ("trtllm_nvfp4_moe", "has_flashinfer_trtllm_fused_moe"),
    "cutedsl": ("flashinfer_cutedsl_moe", "has_flashinfer_cutedsl_moe_nvfp4"),
    "cutedsl_batched": ("flashinfer_cutedsl_batched_moe", "has_flashinfer_cutedsl_grouped_gemm_nt_masked"),
    "cutlass": ("flashinfer_cutlass_moe", "has_flashinfer_cutlass_fused_moe"),
}
FLASHINFER_ALL = frozenset(EXPERTS_MODS)
SM100, SM103, SM90 = (10, 0), (10, 3), (9, 0)


class _HummingGemmType(Enum):  # stand-in for humming's GemmType (values as vLLM compares them, lower-cased)
    INDEXED = "indexed"
    GROUPED_CONTIGUOUS = "grouped_contiguous"


@pytest.fixture(scope="module")
def v():
    """vLLM's modules under test, imported on the real (CPU) platform before anything is faked: some probe the
    platform at import time (``quantization.online.fp8``'s class body calls a ``torch.ops._C`` op under CUDA)."""
    pytest.importorskip("vllm")
    imp = importlib.import_module
    ns = types.SimpleNamespace(
        platforms=imp("vllm.platforms"), iface=imp("vllm.platforms.interface"), config=imp("vllm.config"),
        oracle=imp("vllm.model_executor.layers.fused_moe.oracle.nvfp4"),
        moe_cfg=imp("vllm.model_executor.layers.fused_moe.config"),
        moe_layer=imp("vllm.model_executor.layers.fused_moe.layer"),
        router=imp("vllm.model_executor.layers.fused_moe.router.router_factory"),
        act=imp("vllm.model_executor.layers.fused_moe.activation"),
        modelopt=imp("vllm.model_executor.layers.quantization.modelopt"),
        qu=imp("vllm.model_executor.layers.quantization.utils.quant_utils"),
        fifp4=imp("vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"),
        nvfp4_utils=imp("vllm.model_executor.layers.quantization.utils.nvfp4_utils"),
        param=imp("vllm.model_executor.parameter"),
        experts={k: imp(f"vllm.model_executor.layers.fused_moe.experts.{m}") for k, (m, _) in EXPERTS_MODS.items()},
        humming=imp("vllm.model_executor.layers.fused_moe.experts.fused_humming_moe"),
        marlin=imp("vllm.model_executor.layers.fused_moe.experts.marlin_moe"),
    )
    imp("vllm.model_executor.layers.quantization.online.fp8")
    ns.B = ns.oracle.NvFp4MoeBackend
    ns.current_platform = ns.platforms.current_platform
    return ns


@pytest.fixture
def fake_gpu(v, monkeypatch):
    """``fake_gpu(cap, flashinfer=FLASHINFER_ALL, humming=False)``: make vLLM see a CUDA GPU of compute capability
    ``cap`` with the given FlashInfer MoE entry points (a subset of EXPERTS_MODS' keys) and Humming."""
    for env in ("VLLM_HUMMING_MOE_GEMM_TYPE", "VLLM_BATCH_INVARIANT", "VLLM_MOE_ROUTING_SIMULATION_STRATEGY",
                "VLLM_B12X_MOE_FP4_FORCE_A16"):
        monkeypatch.delenv(env, raising=False)

    def fake(cap, flashinfer=FLASHINFER_ALL, humming=False):
        p = v.current_platform
        monkeypatch.setattr(p, "is_cuda", lambda: True)
        monkeypatch.setattr(p, "is_cuda_alike", lambda: True)
        monkeypatch.setattr(p, "is_cpu", lambda: False)
        dc = v.iface.DeviceCapability(*cap)
        monkeypatch.setattr(type(p), "get_device_capability", classmethod(lambda cls, device_id=0: dc))
        for part, (_, fn) in EXPERTS_MODS.items():
            monkeypatch.setattr(v.experts[part], fn, (lambda on: lambda: on)(part in flashinfer))
        monkeypatch.setattr(v.humming, "has_humming", lambda: humming)
        if humming:
            for cls, t in (("HummingIndexedExperts", "INDEXED"), ("HummingGroupedExperts", "GROUPED_CONTIGUOUS"),
                           ("BatchedHummingGroupedExperts", "GROUPED_CONTIGUOUS")):
                monkeypatch.setattr(getattr(v.humming, cls), "humming_gemm_type",
                                    staticmethod((lambda g: lambda: g)(_HummingGemmType[t])))
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(v.param, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(v.param, "get_tensor_model_parallel_world_size", lambda: 1)
        return p

    return fake


@pytest.fixture(scope="module")
def text_cfg():
    from qwen4exp import presets

    return presets.flash_next().text_config


def parallel(v, tp=1):
    return v.moe_cfg.FusedMoEParallelConfig(
        tp_size=tp, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=1, ep_rank=0, sp_size=1,
        use_ep=False, all2all_backend="allgather_reducescatter", enable_eplb=False)


def moe_config(v, tc, *, num_experts=None, tp=1):
    """FusedMoEConfig as ``FusedMoEFactory`` (layer.py:349) builds it for our experts on a GPU (``fused_experts``:
    softmax top-10, renormalized, no custom routing on CUDA -> vLLM's FusedTopKRouter; silu; bf16; no EP). Call with
    the platform faked (the router class depends on it)."""
    E = num_experts or tc.num_experts
    router = v.router.create_fused_moe_router(top_k=tc.num_experts_per_tok, global_num_experts=E,
                                              renormalize=bool(tc.norm_topk_prob), scoring_func="softmax")
    return v.moe_cfg.FusedMoEConfig(
        num_experts=E, experts_per_token=tc.num_experts_per_tok, hidden_dim=tc.hidden_size,
        intermediate_size=tc.moe_intermediate_size, num_local_experts=E, num_logical_experts=E,
        activation=v.act.MoEActivation.SILU, device="cuda", routing_method=router.routing_method_type,
        moe_parallel_config=parallel(v, tp), in_dtype=torch.bfloat16)


def modelopt_config(v, algo):
    """vLLM's ModelOpt config parsed from our writer's ``quantization_config`` (what config.json carries)."""
    from qwen4exp.quant.export import quantization_config

    d = quantization_config(False, [PREFIX], [], [], weight_only=algo == "W4A16_NVFP4")
    return v.modelopt.ModelOptNvFp4Config.from_config(json.loads(json.dumps(d)))


def ckpt_dir(tmp_path, qcfg: dict) -> str:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen4exp", "quantization_config": qcfg}))
    return str(d)


def select(v, tc, akey):
    return v.oracle.select_nvfp4_moe_backend(moe_config(v, tc), v.qu.kNvfp4Static, akey)


def rand_e4m3(g, *shape):
    # positive finite E4M3 bytes (0x01..0x7E), distinct enough that any reordering shows
    return torch.randint(1, 0x7F, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)


def b(t):  # bytes of a 1-byte tensor, for exact comparisons / sorting (E4M3 sorts poorly)
    return t.detach().view(torch.uint8)


# -- the fake platform ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [SM100, SM103, SM90])
def test_fake_platform_is_what_vllm_sees(v, fake_gpu, cap):
    p = v.current_platform
    if not torch.cuda.is_available():  # the real machine: vLLM's CPU platform, no FlashInfer
        assert p.is_cpu() and not p.is_cuda() and p.get_device_capability() is None
        assert not v.experts["trtllm"].has_flashinfer_trtllm_fused_moe()
    fake_gpu(cap)
    assert p.is_cuda() and p.is_cuda_alike() and not p.is_cpu()
    assert p.get_device_capability().to_int() == cap[0] * 10 + cap[1]
    blackwell = cap[0] == 10
    assert p.is_device_capability_family(100) == blackwell
    assert p.has_device_capability(100) == blackwell and p.has_device_capability(90)
    assert p.is_device_capability(100) == (cap == SM100) and p.is_device_capability(90) == (cap == SM90)
    assert all(getattr(v.experts[k], fn)() for k, (_, fn) in EXPERTS_MODS.items())
    # vLLM's own router choice on CUDA for our routing (CPU would give CPURouter)
    r = v.router.create_fused_moe_router(top_k=10, global_num_experts=512, renormalize=True, scoring_func="softmax")
    assert type(r).__name__ == "FusedTopKRouter"
    assert r.routing_method_type == v.moe_cfg.RoutingMethodType.RenormalizeNaive


# -- backend selection ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo,akey", [("NVFP4", "kNvfp4Dynamic"), ("W4A16_NVFP4", None)])
def test_modelopt_method_passes_the_quant_keys(v, fake_gpu, text_cfg, monkeypatch, algo, akey):
    """The keys ModelOptNvFp4FusedMoE gives the oracle for our writer's W4A4 / weight-only configs (W4A4 stays W4A4:
    vLLM demotes a "NVFP4" config without input_activations to W4A16, ours has them)."""
    fake_gpu(SM103)
    seen = []

    def spy(config, weight_key, activation_key):
        seen.append((config, weight_key, activation_key))
        return v.oracle.select_nvfp4_moe_backend(config, weight_key, activation_key)

    monkeypatch.setattr(v.modelopt, "select_nvfp4_moe_backend", spy)
    qc = modelopt_config(v, algo)
    assert qc.quant_method == algo and qc.is_checkpoint_nvfp4_serialized and qc.group_size == 16
    cfg = moe_config(v, text_cfg)
    m = v.modelopt.ModelOptNvFp4FusedMoE(qc, cfg)
    [(c, wk, ak)] = seen
    assert c is cfg and wk == v.qu.kNvfp4Static and ak == (None if akey is None else getattr(v.qu, akey))
    assert m.use_a16 == (akey is None) and not m.per_token_activation


@pytest.mark.parametrize("cap", [SM100, SM103])
def test_blackwell_with_flashinfer_picks_trtllm_w4a4(v, fake_gpu, text_cfg, cap):
    fake_gpu(cap)
    backend, cls = select(v, text_cfg, v.qu.kNvfp4Dynamic)
    assert backend == v.B.FLASHINFER_TRTLLM
    assert cls.__name__ == "TrtLlmNvFp4ExpertsMonolithic"  # router + experts in one kernel (RenormalizeNaive, bf16)
    # a native FP4 x FP4 kernel: it needs the FP4 activation key and refuses weight-only
    assert cls._supports_quant_scheme(v.qu.kNvfp4Static, v.qu.kNvfp4Dynamic)
    assert not cls._supports_quant_scheme(v.qu.kNvfp4Static, None)
    assert not v.oracle._use_a16(backend, False)
    assert v.oracle.is_global_sf_supported_for_nvfp4_backend(backend)  # one input scale shared by all experts


@pytest.mark.parametrize("cap,parts,want,cls", [
    (SM103, {"cutedsl", "cutedsl_batched", "cutlass"}, "FLASHINFER_CUTEDSL", "FlashInferCuteDSLExperts"),
    (SM103, {"cutlass"}, "FLASHINFER_CUTLASS", "FlashInferExperts"),
    (SM100, set(), "VLLM_CUTLASS", "CutlassExpertsFp4"),
    (SM103, set(), "VLLM_CUTLASS", "CutlassExpertsFp4"),
])
def test_blackwell_fallbacks_without_trtllm(v, fake_gpu, text_cfg, cap, parts, want, cls):
    """FlashInfer builds lacking TRT-LLM-gen MoE fall through the oracle's order; no FlashInfer at all -> vLLM's own
    CUTLASS FP4 MoE (its probe is the platform only). All W4A4."""
    fake_gpu(cap, flashinfer=parts)
    backend, k = select(v, text_cfg, v.qu.kNvfp4Dynamic)
    assert (backend, k.__name__) == (getattr(v.B, want), cls)
    assert not k._supports_quant_scheme(v.qu.kNvfp4Static, None)


@pytest.mark.parametrize("cap", [SM100, SM103])
@pytest.mark.parametrize("humming", [False, True])
def test_w4a16_on_blackwell_is_marlin(v, fake_gpu, text_cfg, cap, humming):
    """A W4A16_NVFP4 checkpoint (activation key None): no FlashInfer / CUTLASS FP4 kernel takes weight-only, so
    Marlin; Humming is preferred over Marlin on SM90 only, so even with it installed Blackwell stays on Marlin."""
    fake_gpu(cap, humming=humming)
    backend, k = select(v, text_cfg, None)
    assert (backend, k) == (v.B.MARLIN, v.marlin.MarlinExperts)


@pytest.mark.parametrize("akey", ["kNvfp4Dynamic", None])
@pytest.mark.parametrize("humming", [True, False])
def test_hopper_is_humming_else_marlin_weight_only(v, fake_gpu, text_cfg, akey, humming):
    """SM90 has no FP4 tensor cores: FlashInfer's CUTLASS MoE (which does run on SM90) takes NVFP4 only from SM100,
    so with FlashInfer present the choice is Humming (moved ahead of Marlin on SM90; its Indexed GEMM without EP)
    else Marlin, for W4A4 and W4A16 checkpoints alike; Marlin runs them weight-only (bf16 activations)."""
    fake_gpu(SM90, humming=humming)
    key = None if akey is None else getattr(v.qu, akey)
    fi = v.experts["cutlass"].FlashInferExperts
    assert fi._supports_current_device() and not fi._supports_quant_scheme(v.qu.kNvfp4Static, key)
    backend, k = select(v, text_cfg, key)
    if humming:
        assert (backend, k) == (v.B.HUMMING, v.humming.HummingIndexedExperts)
        return
    assert (backend, k) == (v.B.MARLIN, v.marlin.MarlinExperts)
    E, H, I = 2, text_cfg.hidden_size, text_cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    qc = v.oracle.make_nvfp4_moe_quant_config(
        backend, w13_scale=rand_e4m3(g, E, 2 * I, H // 16), w2_scale=rand_e4m3(g, E, H, I // 16),
        w13_scale_2=torch.ones(E), w2_scale_2=torch.ones(E), a13_scale=torch.ones(E), a2_scale=torch.ones(E))
    assert qc.use_nvfp4_w4a16 and not qc.use_nvfp4_w4a4 and qc.quant_dtype is None and qc.a1_gscale is None


# -- weight processing ----------------------------------------------------------------------------------------------
@contextmanager
def default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def ckpt_experts(tc, E, seed=0):
    """Per-expert checkpoint tensors in our writer's NVFP4 format (``qwen4exp.quant.experts``): random codes and
    block scales (only the layout matters here), gate/up sharing one ``weight_scale_2`` as the writer ties them."""
    g = torch.Generator().manual_seed(seed)
    H, I = tc.hidden_size, tc.moe_intermediate_size
    out = {}
    for e in range(E):
        gs = torch.rand((), generator=g) + 0.5
        for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out[e, proj] = {"weight": torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=g),
                            "weight_scale": rand_e4m3(g, o, i // 16),
                            "weight_scale_2": gs if proj != "down_proj" else torch.rand((), generator=g) + 0.5,
                            "input_scale": torch.rand((), generator=g) * 0.1 + 0.01}
    return out


class ShuffleRecorder:
    """Stands in for FlashInfer's TRT-LLM shuffle (CUDA ops): records what it is given, returns it unchanged."""

    def __init__(self):
        self.calls = []

    def __call__(self, w13, w2, w13_scale, w2_scale, **kw):
        self.calls.append(dict(kw, w13=w13.clone(), w13_scale=w13_scale.clone(), w2=w2.clone(),
                               w2_scale=w2_scale.clone()))
        return w13, w13_scale, w2, w2_scale


def plugin_experts(v, fake_gpu, monkeypatch, tmp_path, tc, E, algo="NVFP4", cap=SM103):
    """Our plugin's ``fused_experts`` on a faked GPU, as the model builds it (the checkpoint's ModelOpt config as
    vLLM's quant config), with vLLM's real FusedMoEFactory / RoutedExperts. ``check_moe_method`` is recorded, not run
    (see ``test_check_moe_method_accepts_vllm_moe_runner``)."""
    import qwen4exp.vllm.layers as layers
    import qwen4exp.vllm.quant as pq
    from qwen4exp.quant.export import quantization_config

    vcfg = v.config.VllmConfig()  # vLLM's view (built on the real platform)
    fake_gpu(cap)
    qd = quantization_config(False, [PREFIX], [], [], weight_only=algo == "W4A16_NVFP4")
    ours = types.SimpleNamespace(model_config=types.SimpleNamespace(model=ckpt_dir(tmp_path, qd)),
                                 quant_config=v.modelopt.ModelOptNvFp4Config.from_config(json.loads(json.dumps(qd))))
    monkeypatch.setattr(layers, "get_current_vllm_config", lambda: ours)
    checked = []
    monkeypatch.setattr(pq, "check_moe_method", lambda experts, eq, prefix: checked.append((experts, eq, prefix)))
    # one rank, no process group (make_parallel_config's look-ups)
    monkeypatch.setattr(v.moe_layer, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(v.moe_layer, "get_dp_group", lambda: types.SimpleNamespace(world_size=1))
    monkeypatch.setattr(v.moe_layer, "get_pcp_group", lambda: types.SimpleNamespace(world_size=1))
    config = types.SimpleNamespace(num_experts=E, num_experts_per_tok=tc.num_experts_per_tok,
                                   hidden_size=tc.hidden_size, moe_intermediate_size=tc.moe_intermediate_size,
                                   norm_topk_prob=tc.norm_topk_prob)
    with v.config.set_current_vllm_config(vcfg), default_dtype(torch.bfloat16):  # vLLM builds in the model dtype
        experts = layers.fused_experts(config, PREFIX, router=None)
    return experts, checked


def load_as_plugin(experts, ck, weight_only=False):
    """What ``qwen4exp.vllm.weights`` does with a native projection: ``experts.load_weights`` with
    ``{e}.{proj}.{field}`` names (``required_fields``: no input_scale for weight-only)."""
    fields = ("weight", "weight_scale", "weight_scale_2") + (() if weight_only else ("input_scale",))
    names = list(experts.load_weights([(f"{e}.{proj}.{k}", f[k]) for (e, proj), f in ck.items() for k in fields]))
    assert len(names) == len(ck) * len(fields)


@pytest.mark.parametrize("algo,cap,backend,cls", [
    ("NVFP4", SM103, "FLASHINFER_TRTLLM", "TrtLlmNvFp4ExpertsMonolithic"),  # GB300, W4A4
    ("W4A16_NVFP4", SM100, "MARLIN", "MarlinExperts"),  # B200, weight-only
])
def test_plugin_builds_vllm_nvfp4_experts(v, fake_gpu, monkeypatch, tmp_path, text_cfg, algo, cap, backend, cls):
    """On Blackwell the plugin gives its FusedMoE the checkpoint's ModelOpt config: vLLM's ModelOptNvFp4FusedMoE with
    the oracle's backend, on a FusedMoEConfig equal to the one the selection tests build; our loader's names put gate
    in w13's first half, up in its second, per-shard global / input scales in their columns."""
    E = 16  # (the real model has 512: same per-expert shapes, a fraction of the memory)
    wo = algo == "W4A16_NVFP4"
    experts, checked = plugin_experts(v, fake_gpu, monkeypatch, tmp_path, text_cfg, E, algo=algo, cap=cap)
    [(ex, eq, prefix)] = checked
    assert ex is experts and prefix == PREFIX
    assert (eq.fmt, eq.weight_only, eq.native, eq.algo) == ("nvfp4", wo, True, algo)
    assert experts.qwen4exp_quant is eq
    rx = experts.routed_experts
    m = rx.quant_method
    assert type(m).__name__ == "ModelOptNvFp4FusedMoE" and m.use_a16 == wo
    assert m.nvfp4_backend == getattr(v.B, backend) and m.experts_cls.__name__ == cls
    want = moe_config(v, text_cfg, num_experts=E)
    for f in ("num_experts", "experts_per_token", "hidden_dim", "intermediate_size", "intermediate_size_per_partition",
              "activation", "routing_method", "in_dtype", "router_logits_dtype", "moe_parallel_config", "moe_backend",
              "has_bias", "is_lora_enabled", "swiglu_limit"):
        assert getattr(rx.moe_config, f) == getattr(want, f), f
    H, I = text_cfg.hidden_size, text_cfg.moe_intermediate_size
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in rx.named_parameters()}
    assert shapes["w13_weight"] == ((E, 2 * I, H // 2), torch.uint8)
    assert shapes["w2_weight"] == ((E, H, I // 2), torch.uint8)
    assert shapes["w13_weight_scale"] == ((E, 2 * I, H // 16), torch.float8_e4m3fn)
    assert shapes["w2_weight_scale"] == ((E, H, I // 16), torch.float8_e4m3fn)
    assert shapes["w13_weight_scale_2"] == shapes["w13_input_scale"] == ((E, 2), torch.float32)
    ck = ckpt_experts(text_cfg, E)
    load_as_plugin(experts, ck, weight_only=wo)
    for e in (0, E - 1):
        assert torch.equal(b(rx.w13_weight[e, :I]), ck[e, "gate_proj"]["weight"])
        assert torch.equal(b(rx.w13_weight[e, I:]), ck[e, "up_proj"]["weight"])
        assert torch.equal(b(rx.w13_weight_scale[e, I:]), b(ck[e, "up_proj"]["weight_scale"]))
        assert torch.equal(b(rx.w2_weight[e]), ck[e, "down_proj"]["weight"])
        assert rx.w13_weight_scale_2[e].tolist() == [float(ck[e, "gate_proj"]["weight_scale_2"])] * 2
        if not wo:
            assert rx.w13_input_scale[e].tolist() == [float(ck[e, p]["input_scale"]) for p in ("gate_proj",
                                                                                                  "up_proj")]
            assert float(rx.w2_input_scale[e]) == float(ck[e, "down_proj"]["input_scale"])


def test_gb300_trtllm_weight_processing(v, fake_gpu, monkeypatch, tmp_path, text_cfg):
    """``process_weights_after_loading`` on GB300 (FLASHINFER_TRTLLM), as vLLM's loader calls it, with only
    FlashInfer's shuffle stood in: w1/w3 -> w3/w1 (weights and block scales), no padding at TP=1 (2560 % 256, 640 %
    64), one input scale for all experts (the max), folded into the global scales by the TRT-LLM experts;
    ``a1_gscale = 1 / input_scale``; unswizzled block scales for the shuffle."""
    E = 16
    experts, _ = plugin_experts(v, fake_gpu, monkeypatch, tmp_path, text_cfg, E)
    rx = experts.routed_experts
    m = rx.quant_method
    ck = ckpt_experts(text_cfg, E)
    load_as_plugin(experts, ck)
    shuffle = ShuffleRecorder()
    monkeypatch.setattr(v.fifp4, "prepare_static_weights_for_trtllm_fp4_moe", shuffle)
    m.process_weights_after_loading(rx)

    H, I = text_cfg.hidden_size, text_cfg.moe_intermediate_size
    [call] = shuffle.calls
    assert (call["hidden_size"], call["intermediate_size"], call["num_experts"], call["is_gated_activation"]) == (
        H, I, E, True)
    stack = lambda proj, k: torch.stack([b(ck[e, proj][k]) for e in range(E)])  # noqa: E731
    assert torch.equal(b(call["w13"]), torch.cat([stack("up_proj", "weight"), stack("gate_proj", "weight")], 1))
    assert torch.equal(b(call["w13_scale"]), torch.cat([stack("up_proj", "weight_scale"),
                                                        stack("gate_proj", "weight_scale")], 1))
    assert torch.equal(b(call["w2"]), stack("down_proj", "weight"))
    assert torch.equal(b(call["w2_scale"]), stack("down_proj", "weight_scale"))
    assert rx.moe_config.hidden_dim == H and rx.moe_config.intermediate_size_per_partition == I

    a13 = max(float(ck[e, p]["input_scale"]) for e in range(E) for p in ("gate_proj", "up_proj"))
    a2 = max(float(ck[e, "down_proj"]["input_scale"]) for e in range(E))
    gs13 = torch.tensor([float(ck[e, "gate_proj"]["weight_scale_2"]) for e in range(E)])
    gs2 = torch.tensor([float(ck[e, "down_proj"]["weight_scale_2"]) for e in range(E)])
    assert rx.w13_input_scale.shape == (E,) and torch.all(rx.w13_input_scale == a13)
    assert rx.w2_input_scale.shape == (E,) and torch.all(rx.w2_input_scale == a2)
    torch.testing.assert_close(rx.w13_weight_scale_2, gs13 * a13)  # g1_alphas = weight_scale_2 * input_scale
    torch.testing.assert_close(rx.w2_weight_scale_2, gs2 * a2)
    torch.testing.assert_close(rx.g1_scale_c, gs13 * a13 / a2)  # g1_alphas * a2_gscale
    qc = m.moe_quant_config
    assert qc.use_nvfp4_w4a4 and qc.quant_dtype == "nvfp4" and not qc.is_scale_swizzled
    torch.testing.assert_close(qc.a1_gscale, torch.full((E,), 1 / a13))
    torch.testing.assert_close(qc.a2_gscale, torch.full((E,), 1 / a2))
    assert qc.g1_alphas.data_ptr() == rx.w13_weight_scale_2.data_ptr()  # the folded parameter itself (EPLB-safe)
    assert type(m.moe_kernel.fused_experts).__name__ == "TrtLlmNvFp4ExpertsMonolithic"


def method_layer(v, tc, E, tp=1, seed=1):
    """ModelOptNvFp4FusedMoE on a bare module (RoutedExperts' attributes the method reads), weights filled in vLLM's
    loaded layout; gate and up global scales deliberately different (vLLM keeps w1's, with a warning)."""
    m = v.modelopt.ModelOptNvFp4FusedMoE(modelopt_config(v, "NVFP4"), moe_config(v, tc, num_experts=E, tp=tp))
    layer = torch.nn.Module()
    layer.activation, layer.moe_config = v.act.MoEActivation.SILU, m.moe
    layer._expert_routing_tables = lambda: None
    Ip = tc.moe_intermediate_size // tp
    m.create_weights(layer, E, tc.hidden_size, Ip, torch.bfloat16, weight_loader=None, global_num_experts=E)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in ("w13_weight", "w2_weight"):
            getattr(layer, n).copy_(torch.randint(0, 256, getattr(layer, n).shape, dtype=torch.uint8, generator=g))
        for n in ("w13_weight_scale", "w2_weight_scale"):
            b(getattr(layer, n)).copy_(b(rand_e4m3(g, *getattr(layer, n).shape)))
        for n in ("w13_weight_scale_2", "w2_weight_scale_2"):
            getattr(layer, n).copy_(torch.rand(getattr(layer, n).shape, generator=g) + 0.5)
        for n in ("w13_input_scale", "w2_input_scale"):
            getattr(layer, n).copy_(torch.rand(getattr(layer, n).shape, generator=g) * 0.1 + 0.01)
    orig = {n: p.detach().clone() for n, p in layer.named_parameters()}
    return m, layer, orig


def unswizzle(s, M, K):
    """Inverse of vLLM's ``swizzle_blockscale`` ([B, M, K] -> padded [B, M128, K4] in 128x4 tiles)."""
    B, Mp, Kp = s.shape
    u = s.reshape(B, Mp // 128, Kp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(B, Mp, Kp)
    assert not torch.any(b(u[:, M:])) and not torch.any(b(u[:, :, K:]))  # padding is zero
    return u[:, :M, :K]


def test_swizzle_blockscale_is_a_tile_permutation(v, fake_gpu):
    fake_gpu(SM103)  # (only for its ``Tensor.cuda`` stand-in)
    g = torch.Generator().manual_seed(2)
    for shape in ((2, 1280, 160), (3, 2560, 40), (2, 200, 10)):  # w13 / w2 scales of our experts; a padded one
        s = rand_e4m3(g, *shape)
        z = v.nvfp4_utils.swizzle_blockscale(s)
        Mp, Kp = -(-shape[1] // 128) * 128, -(-shape[2] // 4) * 4
        assert z.shape == (shape[0], Mp, Kp) and z.dtype == torch.float8_e4m3fn
        assert torch.equal(b(unswizzle(z, *shape[1:])), b(s))
        padded = torch.nn.functional.pad(b(s), (0, Kp - shape[2], 0, Mp - shape[1]))
        assert torch.equal(b(z).flatten(1).sort(1).values, padded.flatten(1).sort(1).values)
        assert not torch.equal(b(z)[:, :shape[1], :shape[2]], b(s))  # it does move things


@pytest.mark.parametrize("parts,backend", [({"cutlass"}, "FLASHINFER_CUTLASS"), (set(), "VLLM_CUTLASS")])
def test_cutlass_backends_weight_processing(v, fake_gpu, text_cfg, parts, backend):
    """FlashInfer CUTLASS (w3/w1 order, one input scale for all experts) and vLLM CUTLASS (w1/w3 kept, each expert's
    input scale the max of its two shards): block scales swizzled (a tile permutation), global scales = w1's x the
    input scale, ``a1_gscale = 1 / input_scale``, swizzled-scale quant config."""
    fake_gpu(SM103, flashinfer=parts)
    E, H, I = 4, text_cfg.hidden_size, text_cfg.moe_intermediate_size
    m, layer, o = method_layer(v, text_cfg, E)
    assert m.nvfp4_backend == getattr(v.B, backend)
    m.process_weights_after_loading(layer)

    fi = backend == "FLASHINFER_CUTLASS"
    w31 = lambda t: torch.cat([t[:, I:], t[:, :I]], 1)  # noqa: E731
    assert torch.equal(layer.w13_weight, w31(o["w13_weight"]) if fi else o["w13_weight"])
    assert torch.equal(layer.w2_weight, o["w2_weight"])
    w13s = w31(o["w13_weight_scale"]) if fi else o["w13_weight_scale"]
    assert layer.w13_weight_scale.shape == (E, 2 * I, H // 16) and layer.w2_weight_scale.shape == (E, H, I // 16)
    assert torch.equal(b(unswizzle(layer.w13_weight_scale, 2 * I, H // 16)), b(w13s))
    assert torch.equal(b(unswizzle(layer.w2_weight_scale, H, I // 16)), b(o["w2_weight_scale"]))
    for new, old in ((layer.w13_weight_scale, w13s), (layer.w2_weight_scale, o["w2_weight_scale"])):
        assert torch.equal(b(new).flatten(1).sort(1).values, b(old).flatten(1).sort(1).values)
    if fi:
        a13 = torch.full((E,), float(o["w13_input_scale"].max()))
        a2 = torch.full((E,), float(o["w2_input_scale"].max()))
    else:
        a13, a2 = o["w13_input_scale"].max(dim=1).values, o["w2_input_scale"]
    torch.testing.assert_close(layer.w13_input_scale, a13)
    torch.testing.assert_close(layer.w2_input_scale, a2)
    torch.testing.assert_close(layer.w13_weight_scale_2, o["w13_weight_scale_2"][:, 0] * a13)
    torch.testing.assert_close(layer.w2_weight_scale_2, o["w2_weight_scale_2"] * a2)
    qc = m.moe_quant_config
    assert qc.use_nvfp4_w4a4 and qc.is_scale_swizzled
    torch.testing.assert_close(qc.a1_gscale, 1 / a13)
    torch.testing.assert_close(qc.a2_gscale, 1 / a2)
    assert type(m.moe_kernel.fused_experts).__name__ == ("FlashInferExperts" if fi else "CutlassExpertsFp4")


def test_trtllm_pads_the_tp4_intermediate(v, fake_gpu, text_cfg, monkeypatch):
    """At TP=4 an expert's intermediate is 640 / 4 = 160, not a multiple of 64: the TRT-LLM path pads it to 192,
    gate and up each at their own aligned offset (up first), zeros in between; w2 padded on its input side."""
    fake_gpu(SM103)
    E, H, tp = 2, text_cfg.hidden_size, 4
    I = text_cfg.moe_intermediate_size // tp
    m, layer, o = method_layer(v, text_cfg, E, tp=tp)
    assert m.nvfp4_backend == v.B.FLASHINFER_TRTLLM and m.moe.intermediate_size_per_partition == I == 160
    shuffle = ShuffleRecorder()
    monkeypatch.setattr(v.fifp4, "prepare_static_weights_for_trtllm_fp4_moe", shuffle)
    m.process_weights_after_loading(layer)
    [c] = shuffle.calls
    P = 192
    assert (c["hidden_size"], c["intermediate_size"]) == (H, P)
    assert layer.moe_config.intermediate_size_per_partition == P
    for got, src, cols in ((b(c["w13"]), b(o["w13_weight"]), H // 2), (b(c["w13_scale"]), b(o["w13_weight_scale"]),
                                                                       H // 16)):
        assert got.shape == (E, 2 * P, cols)
        assert torch.equal(got[:, :I], src[:, I:]) and torch.equal(got[:, P:P + I], src[:, :I])  # up, then gate
        assert not got[:, I:P].any() and not got[:, P + I:].any()
    assert b(c["w2"]).shape == (E, H, P // 2) and torch.equal(b(c["w2"])[:, :, :I // 2], b(o["w2_weight"]))
    assert not b(c["w2"])[:, :, I // 2:].any()
    assert b(c["w2_scale"]).shape == (E, H, P // 16)
    assert torch.equal(b(c["w2_scale"])[:, :, :I // 16], b(o["w2_weight_scale"]))


@pytest.mark.parametrize("parts", [{"cutlass"}, set()])
def test_cutlass_backends_refuse_the_tp4_intermediate(v, fake_gpu, text_cfg, parts):
    """vLLM 0.32's CUTLASS NVFP4 MoE paths (FlashInfer's and vLLM's) cannot pad a gated intermediate: at TP=4 (160
    rows per shard, swizzled to 384 for 2 x 160) loading fails. Blackwell with TRT-LLM-gen FlashInfer is unaffected
    (previous test); one without it (or SM120) cannot serve our model at TP=4."""
    fake_gpu(SM103, flashinfer=parts)
    m, layer, _ = method_layer(v, text_cfg, 2, tp=4)
    assert m.nvfp4_backend in (v.B.FLASHINFER_CUTLASS, v.B.VLLM_CUTLASS)
    with pytest.raises(NotImplementedError, match="Intermediate size padding"):
        m.process_weights_after_loading(layer)


def test_trtllm_shuffle_with_flashinfer(v, text_cfg):
    """The step stood in above: FlashInfer's TRT-LLM shuffle permutes each expert's rows and interleaves its block
    scales (a permutation of the same bytes, same shapes)."""
    if importlib.util.find_spec("flashinfer") is None or not torch.cuda.is_available():
        pytest.skip("FlashInfer's TRT-LLM NVFP4 MoE shuffle (permute indices + nvfp4_block_scale_interleave) needs the "
                    "flashinfer package and a CUDA GPU; neither is on this machine")
    E, H, I = 2, text_cfg.hidden_size, text_cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(3)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g).cuda()
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g).cuda()
    s13, s2 = rand_e4m3(g, E, 2 * I, H // 16).cuda(), rand_e4m3(g, E, H, I // 16).cuda()
    out = v.fifp4.prepare_static_weights_for_trtllm_fp4_moe(w13, w2, s13, s2, hidden_size=H, intermediate_size=I,
                                                             num_experts=E, is_gated_activation=True)
    for new, old in zip(out, (w13, s13, w2, s2)):
        assert b(new).numel() == b(old).numel()
        assert torch.equal(b(new).reshape(E, -1).sort(1).values, b(old).reshape(E, -1).sort(1).values)


# -- the plugin's decision ------------------------------------------------------------------------------------------
def plugin_vllm_config(path):
    # a fresh namespace per case: ``checkpoint_quant`` caches on the model config (``_qwen4exp_quant``)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(model=path))


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"])
def test_experts_quant_native_on_cuda_only(v, tmp_path, monkeypatch, algo):
    from qwen4exp.quant.export import quantization_config
    from qwen4exp.vllm.quant import experts_quant, native_quantized_moe

    mixed = algo == "MIXED_PRECISION"
    qd = quantization_config(False, [PREFIX], ["mtp.layers.0.mlp.experts"] if mixed else [], [],
                             weight_only=algo == "W4A16_NVFP4")
    path = ckpt_dir(tmp_path, qd)
    want = ("nvfp4", algo == "W4A16_NVFP4", "NVFP4" if mixed else algo)
    assert not native_quantized_moe()  # this machine: CPU
    eq = experts_quant(plugin_vllm_config(path), PREFIX)
    assert (eq.fmt, eq.weight_only, eq.algo) == want and not eq.native
    monkeypatch.setattr(v.current_platform, "is_cuda_alike", lambda: True)
    assert native_quantized_moe()
    eq = experts_quant(plugin_vllm_config(path), PREFIX)
    assert (eq.fmt, eq.weight_only, eq.algo) == want and eq.native
    mtp = experts_quant(plugin_vllm_config(path), "mtp.layers.0.mlp.experts")
    if mixed:  # the MTP head's block-FP8 experts: vLLM's Fp8MoEMethod, also native
        assert (mtp.fmt, mtp.weight_only, mtp.native, mtp.algo) == ("fp8_block", True, True, "FP8_PB_WO")
    else:  # "*mtp*" is in the ignore list: unquantized, whatever the platform
        assert (mtp.fmt, mtp.native, mtp.algo) == (None, False, None)


def test_check_moe_method_names_a_mismatch(v, fake_gpu, text_cfg):
    from qwen4exp.vllm.quant import ExpertsQuant, check_moe_method

    eq = ExpertsQuant("nvfp4", False, True, "NVFP4")

    class UnquantizedFusedMoEMethod:  # what vLLM gives experts it does not see as quantized
        pass

    for method in (UnquantizedFusedMoEMethod(), None):
        with pytest.raises(QuantConfigError, match=rf"{PREFIX} are NVFP4 in the checkpoint, but vLLM's quant config "
                                                   rf"gives them {type(method).__name__} \(expected "
                                                   r"ModelOptNvFp4FusedMoE\)"):
            check_moe_method(types.SimpleNamespace(quant_method=method), eq, PREFIX)
    fake_gpu(SM103)
    real = v.modelopt.ModelOptNvFp4FusedMoE(modelopt_config(v, "NVFP4"), moe_config(v, text_cfg))
    check_moe_method(types.SimpleNamespace(quant_method=real), eq, PREFIX)  # accepted
    with pytest.raises(QuantConfigError, match=r"FP8_PB_WO .* gives them ModelOptNvFp4FusedMoE \(expected "
                                               r"Fp8MoEMethod\)"):
        check_moe_method(types.SimpleNamespace(quant_method=real), ExpertsQuant("fp8_block", True, True, "FP8_PB_WO"),
                         PREFIX)


def test_check_moe_method_accepts_vllm_moe_runner(v, fake_gpu, monkeypatch, tmp_path, text_cfg):
    from qwen4exp.vllm.quant import check_moe_method

    experts, [(_, eq, prefix)] = plugin_experts(v, fake_gpu, monkeypatch, tmp_path, text_cfg, 10)
    assert type(experts).__name__ == "MoERunner"
    assert type(experts.routed_experts.quant_method).__name__ == "ModelOptNvFp4FusedMoE"
    check_moe_method(experts, eq, prefix)
