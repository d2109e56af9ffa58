"""The slow, obviously correct Long-Short attention: dense n x n scores with the LS mask spelled out.

Built from the paper's definitions (Sec. 3.2-3.4, Eq. 3-7, Appendix D) with explicit loops over positions,
sharing no code with ``ls_hf.long_short_attention`` apart from reading its parameters.
"""

import math

import torch


def _ln(module, name, x):
    """DualLN over the full width of a (L, H*d) tensor; identity when DualLN is off."""
    if not module.use_dual_ln:
        return x
    key_name = name + "_key"
    ln = getattr(module, key_name) if x.shape[-1] != module.num_heads * module.head_dim else None
    ln = ln or getattr(module, name)
    return torch.nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def reference_attention(module, x, mask=None, cls=None, global_mask=None):
    """Long-Short attention of ``module``'s weights on x (B, n, d), one sample at a time; ``global_mask`` (B, n)
    marks global tokens."""
    B, n, _ = x.shape
    mask = torch.ones(B, n, dtype=torch.bool) if mask is None else mask.bool()
    glob = torch.zeros(B, n, dtype=torch.bool) if global_mask is None else global_mask.bool() & mask
    outs = [_one(module, x[b], mask[b], None if cls is None else cls[b], glob[b]) for b in range(B)]
    return torch.stack(outs)


def _one(m, x, valid, cls, glob):
    """Global tokens: every other token sees LN_G of their raw key/value (first columns); the window counts the other
    tokens only (a token's window position is how many non-global tokens precede it) and the projection pools them
    only; a global token attends to the projected rows and every real token's LN_L key. Causally, positions count
    from the first real token (left padding is not counted)."""
    n = x.shape[0]
    first = int(valid.int().argmax()) if m.causal else 0  # the first real token (0 for a row of padding only)
    rank = torch.cumsum((~glob).long(), 0) - 1 - first  # window position of each non-global token
    local = valid & ~glob
    H, w, r = m.num_heads, m.window_size, m.projection_rank
    dq = m.qk_head_dim
    q = m.query(x).view(n, H, dq)
    k = _ln(m, "dual_ln_local", m.key(x)).view(n, H, dq)
    v = _ln(m, "dual_ln_local", m.value(x)).view(n, H, -1)
    # Projected rows and which query sees which row.
    rows_k, rows_v, rows_seen = [], [], []  # rows_seen[j](i) -> bool
    for g in [cls] if cls is not None else [x[j : j + 1] for j in range(n) if glob[j]]:
        rows_k.append(m.key(g).view(1, -1))
        rows_v.append(m.value(g).view(1, -1))
        rows_seen.append(lambda i: True)
    if r:
        scores = m.dynamic_projection(x).view(n, H, r)
        seg_len = m.segment_length if m.causal else n
        for s in range((n - first) // seg_len):
            pos = [first + t for t in range(s * seg_len, (s + 1) * seg_len) if local[first + t]]
            if not pos:
                continue
            p = scores[pos].softmax(dim=0)  # (|pos|, H, r), softmax over the segment's real tokens (Eq. 3)
            kb = torch.einsum("lhr,lhd->rhd", p, k[pos]).reshape(r, -1)
            vb = torch.einsum("lhr,lhd->rhd", p, v[pos]).reshape(r, -1)
            for j in range(r):
                rows_k.append(kb[j : j + 1])
                rows_v.append(vb[j : j + 1])
                rows_seen.append((lambda i, s=s: s < rank[i] // seg_len) if m.causal else (lambda i: True))
    R = len(rows_k)
    G = len(rows_k) - (r if r and not m.causal and local.any() else 0)  # the global rows come first
    if R:
        kbar = _ln(m, "dual_ln_global", torch.cat(rows_k)).view(R, H, dq)
        vbar = _ln(m, "dual_ln_global", torch.cat(rows_v)).view(R, H, -1)

    def window_sees(i, j):
        if not local[j]:
            return False
        i, j = rank[i], rank[j]
        seg = (i // w) * w
        if m.causal:
            return seg - w <= j <= i
        e = max(w // 2, 1)
        return seg - e <= j < seg + w + e

    context = torch.zeros(n, H, v.shape[-1], dtype=x.dtype)
    for i in range(n):
        if not local[i]:
            continue  # padded queries get context 0; global ones are below
        cols_k, cols_v = [], []
        for j in range(R):
            if rows_seen[j](i):
                cols_k.append(kbar[j])
                cols_v.append(vbar[j])
        for j in range(n):
            if w and window_sees(i, j):
                cols_k.append(k[j])
                cols_v.append(v[j])
        ks, vs = torch.stack(cols_k, 1), torch.stack(cols_v, 1)  # (H, K, d)
        prob = (torch.einsum("hd,hkd->hk", q[i], ks) / math.sqrt(dq)).softmax(-1)
        context[i] = torch.einsum("hk,hkd->hd", prob, vs)
    for i in range(n):  # a global token: the projected rows and every real token, one softmax
        if not glob[i]:
            continue
        qp, kp, vp = (getattr(m, "global_" + name) or getattr(m, name) for name in ("query", "key", "value"))
        qg = qp(x[i]).view(H, dq)
        kg = _ln(m, "dual_ln_local", kp(x[valid])).view(-1, H, dq)
        vg = _ln(m, "dual_ln_local", vp(x[valid])).view(-1, H, v.shape[-1])
        if R > G:
            kg, vg = torch.cat([kbar[G:], kg]), torch.cat([vbar[G:], vg])
        prob = (torch.einsum("hd,khd->hk", qg, kg) / math.sqrt(dq)).softmax(-1)
        context[i] = torch.einsum("hk,khd->hd", prob, vg)
    if cls is not None:  # the cls token attends to its raw key/value and the tokens' contexts
        qc = m.query(cls).view(H, dq)
        kc, vc = m.key(cls).view(1, H, -1), m.value(cls).view(1, H, -1)
        real = context[valid]
        ks, vs = torch.cat([kc, real]), torch.cat([vc, real])
        prob = (torch.einsum("hd,khd->hk", qc, ks) / math.sqrt(dq)).softmax(-1)
        context = torch.cat([torch.einsum("hk,khd->hd", prob, vs)[None], context])
    return m.output(context.reshape(context.shape[0], -1))


def reference_xl_attention(module, h, memory=None):
    """``LongShortXLAttention`` by its definition, one query at a time: h (B, n, d) and memory (B, L, d) are the
    normalised inputs of the block and of the tokens before it; positions count from the first memory token."""
    import torch.nn.functional as F

    def ln(name, x):
        if not module.use_dual_ln:
            return x
        norm = getattr(module, name)
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def sinusoid(distance, width):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
        angle = distance * inv_freq
        return torch.cat([angle.sin(), angle.cos()]).to(h.dtype)

    B, n, d = h.shape
    L = 0 if memory is None else memory.shape[1]
    H, w, r, l = module.num_heads, module.window_size, module.projection_rank, module.segment_length
    dh = d // H
    outs = []
    for b in range(B):
        x = h[b] if memory is None else torch.cat([memory[b], h[b]])
        keys, values = ln("dual_ln_local", module.key(x)), ln("dual_ln_local", module.value(x))
        rows_k, rows_v = [], []  # per finished segment: (r, d)
        for s in range((L + n) // l):
            seg = x[s * l : (s + 1) * l]
            prob = module.dynamic_projection(seg).view(l, H, r).softmax(0)  # over the segment
            if module.projection_input == "normalized":
                src_k, src_v = keys[s * l : (s + 1) * l], values[s * l : (s + 1) * l]
            elif (s + 1) * l <= L:  # official memory: pool the input's head slices, then project
                pooled = torch.einsum("lhr,lhd->rhd", prob, seg.view(l, H, dh)).reshape(r, d)
                rows_k.append(ln("dual_ln_global", module.key(pooled)))
                rows_v.append(ln("dual_ln_global", module.value(pooled)))
                continue
            else:
                src_k, src_v = module.key(seg), module.value(seg)
            rows_k.append(ln("dual_ln_global", torch.einsum("lhr,lhd->rhd", prob, src_k.view(l, H, dh)).reshape(r, d)))
            rows_v.append(ln("dual_ln_global", torch.einsum("lhr,lhd->rhd", prob, src_v.view(l, H, dh)).reshape(r, d)))
        out = []
        for t in range(L, L + n):
            q = module.query(x[t]).view(H, dh) / math.sqrt(dh)
            if module.window_rule == "token":
                window = range(max(0, t - w + 1), t + 1)
            else:
                window = range(max(0, t // w * w - w), t + 1)
            scores, vals = [], []
            for j in window:
                rel = module.window_position(sinusoid(t - j, d)).view(H, dh)
                scores.append(
                    ((q + module.content_bias) * keys[j].view(H, dh)).sum(-1)
                    + ((q + module.position_bias) * rel).sum(-1)
                )
                vals.append(values[j].view(H, dh))
            a = t // l
            for s in range(a):  # finished segments before the query's own
                for i in range(r):
                    c = s * r + i
                    rel = module.row_position(sinusoid(a * r - 1 - c, d)).view(H, dh)
                    scores.append((q * (rows_k[s][i].view(H, dh) + rel)).sum(-1))
                    vals.append(rows_v[s][i].view(H, dh))
            prob = torch.stack(scores, -1).softmax(-1)  # (H, K)
            out.append(torch.einsum("hk,khd->hd", prob, torch.stack(vals)).reshape(d))
        outs.append(module.output(torch.stack(out)))
    return torch.stack(outs)
