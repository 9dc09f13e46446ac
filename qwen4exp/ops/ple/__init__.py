from .._dispatch import pick
from . import reference
from .reference import (hash_multipliers, head_table_sizes, ngram_context, ngram_context_decode, splitmix64,
                        table_rows)


def ngram_ids(ctx, multipliers, head_sizes, head_offsets, heads_per_ngram):
    fn = pick("ple_ngram_ids", ctx.device, reference.ngram_ids)
    return fn(ctx, multipliers, head_sizes, head_offsets, heads_per_ngram)


def ple_lookup(table, rows, scale=None, out_dtype=None):
    return pick("ple_lookup", rows.device, reference.ple_lookup)(table, rows, scale, out_dtype)


__all__ = ["ngram_context", "ngram_context_decode", "ngram_ids", "ple_lookup", "hash_multipliers",
           "head_table_sizes", "splitmix64", "table_rows", "reference"]
