"""The HF runtime's packed forward: decoder layers run over the packed tokens of a batch, each layer's per-row state
bound from the hybrid cache (``hf.cache``) and updated in place. With a journal, every state update is recorded so
that ``rollback`` keeps only a prefix of the tokens (speculative decoding, ``hf.mtp``).

Used by the text model (``hf.modeling``) and the MTP head (``hf.mtp``).
"""

from __future__ import annotations

import torch

from ..configuration import LINEAR
from ..modeling import next_mixer
from ..ops.qsa import block_mean, qsa_attention


def _qsa_mix(attn, rotary, x, cos, sin, positions, tok_idx, cu_seqlens, row_states):
    """QSA over packed tokens with per-row caches: store K/V, complete block keys incrementally, select, attend."""
    p = attn.project(x, cos, sin)
    out = torch.empty_like(p.q)
    r = attn.r
    cu = cu_seqlens.tolist()
    for b, st in enumerate(row_states):
        s, e = cu[b], cu[b + 1]
        if s == e:
            continue
        st.k.append(p.k[s:e])
        st.v.append(p.v[s:e])
        raw, pos = p.index_k_raw[s:e], positions[..., s:e]
        st.pending_raw, st.pending_pos = raw, pos
        if st.open_keys is not None and st.open_keys.shape[0]:
            raw = torch.cat([st.open_keys, raw], 0)
            pos = torch.cat([st.open_pos, pos], -1)
        nfull = raw.shape[0] // r
        if nfull:
            cb, sb = rotary(pos[..., : nfull * r: r], raw.dtype)
            st.block_keys.append(attn.block_keys(block_mean(raw[: nfull * r], r), cb, sb))
        st.open_keys, st.open_pos = raw[nfull * r:], pos[..., nfull * r:]
        out[s:e] = qsa_attention(p.q[s:e], st.k.view(), st.v.view(), tok_idx[s:e], p.index_q[s:e],
                                 st.block_keys.view(), r, attn.budget, attn.scale, attn.index_scale)
    return attn.output(out, p.gate)


def run_layers(layers, H, ids, positions, cu_seqlens, layer_states, rows, starts, rotary, journal=None, final=None):
    """Run decoder layers over packed tokens, binding each layer's per-row state (updated in place) -> (H, H
    normalised for the ``final`` mixer, or None without it).

    ``starts`` [N]: tokens each sequence had consumed before (QSA token indices). With a ``journal`` list, every
    state update is recorded so that ``rollback`` can keep only a prefix of these tokens (speculative decoding).
    """
    cos, sin = rotary(positions, H.dtype)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    tok_idx = torch.repeat_interleave(starts.to(ids.device) - cu_seqlens[:-1], lens) + \
        torch.arange(ids.numel(), device=ids.device)
    rows_l = rows.tolist()
    Hn = None
    for i, (layer, st) in enumerate(zip(layers, layer_states)):
        ple_fn = None
        if layer.ple is not None:
            def ple_fn(H, layer=layer, st=st):
                prev = (st["ple_ctx"][rows], st["ple_conv"][rows])
                if journal is not None:
                    journal.append(("ple", layer, st, rows, prev, H, ids))
                out, st["ple_ctx"][rows], st["ple_conv"][rows] = layer.ple(H, ids, cu_seqlens, *prev)
                return out
        if layer.layer_type == LINEAR:
            def mix(x, layer=layer, st=st):
                prev = (st["conv"][rows], st["ssm"][rows])
                if journal is not None:
                    journal.append(("gdn", layer, st, rows, prev, x, None))
                y, st["conv"][rows], st["ssm"][rows] = layer.linear_attn(x, cu_seqlens, *prev)
                return y
        else:
            def mix(x, layer=layer, st=st):
                row_states = [st["qsa"][r] for r in rows_l]
                if journal is not None:
                    journal.append(("qsa", layer, st, rows, [(rs.k.len, rs.block_keys.len, rs.open_keys,
                                                              rs.open_pos) for rs in row_states], None, None))
                return _qsa_mix(layer.self_attn, rotary, x, cos, sin, positions, tok_idx, cu_seqlens, row_states)
        H, Hn = layer(H, mix, ple_fn, Hn, next_mixer(layers, i, final))
    return H, Hn


def rollback(journal, keep: int, rotary) -> None:
    """Undo the journaled forward of ONE sequence except its first ``keep`` tokens: restore each state and replay the
    state update (not the whole model) on the kept tokens; QSA caches are cropped and their open block rebuilt."""
    for kind, layer, st, rows, prev, inp, ids in journal:
        cu = torch.tensor([0, keep], device=rows.device)
        if kind == "gdn":
            _, st["conv"][rows], st["ssm"][rows] = layer.linear_attn(inp[:keep], cu, *prev)
        elif kind == "ple":
            _, st["ple_ctx"][rows], st["ple_conv"][rows] = layer.ple(inp[:keep], ids[:keep], cu, *prev)
        else:
            for r, (klen, blen, open_k, open_p) in zip(rows.tolist(), prev):
                rs = st["qsa"][r]
                new_raw = rs.pending_raw
                rs.k.len = rs.v.len = klen + keep
                raw = torch.cat([x for x in (open_k, new_raw[:keep]) if x is not None], 0)
                pos = torch.cat([x for x in (open_p, rs.pending_pos[..., :keep]) if x is not None], -1)
                r_ = layer.self_attn.r
                nfull = raw.shape[0] // r_
                rs.block_keys.len = blen + nfull
                rs.open_keys, rs.open_pos = raw[nfull * r_:], pos[..., nfull * r_:]
    journal.clear()
