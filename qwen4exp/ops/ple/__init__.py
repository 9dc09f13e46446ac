"""PLE (the hashed n-gram embedding and its mix into the streams): ``reference`` (readable torch, the contract),
``triton_kernel`` (the CUDA kernels), ``cuda`` (their registration as custom operators and the host wrappers),
``host`` (what the kernels cover; Triton-free). Tests: ``tests/ops/test_ple.py``."""

from .. import _registry
from . import reference
from .reference import (hash_multipliers, head_table_sizes, ngram_context, ngram_context_decode, splitmix64,
                        table_rows)

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def ngram_ids(ctx, multipliers, head_sizes, head_offsets, heads_per_ngram):
    """The hashed n-gram row ids (the reference on every device: a few integer ops a token, which the CUDA path
    folds into ``ngram_lookup_decode`` at decode)."""
    return reference.ngram_ids(ctx, multipliers, head_sizes, head_offsets, heads_per_ngram)


def ple_lookup(table, rows, scale=None, out_dtype=None):
    return pick("ple_lookup", rows.device, reference.ple_lookup)(table, rows, scale, out_dtype)


def lookup_to(device, table, rows, scale=None, out_dtype=None):
    """``ple_lookup`` (this dispatcher's) with the result on ``device``: a pinned host table with rows for a GPU is
    gathered by the GPU through unified addressing (only the rows cross the bus), any other table where it is."""
    return reference.gather_to(device, table, rows, scale, out_dtype, ple_lookup)


def ngram_lookup_decode(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale,
                        out_dtype):
    fn = pick("ngram_lookup_decode", ids.device, reference.ngram_lookup_decode)
    return fn(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale, out_dtype)


def ple_mix(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state, n, eps, dilation):
    fn = pick("ple_mix", H.device, reference.ple_mix)
    return fn(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state, n, eps, dilation)


__all__ = ["ngram_context", "ngram_context_decode", "ngram_ids", "ngram_lookup_decode", "ple_lookup", "ple_mix",
           "lookup_to", "hash_multipliers", "head_table_sizes", "splitmix64", "table_rows", "reference"]
