"""Randomized differential test: cuflash on the CPU (the C++ reference, the GPU tests' oracle)
against the NumPy float64 reference (attention_reference.py), over random combinations of every
option: layouts (dense, packed with zero-length sequences and padding, paged with shared pages),
seqused and max_seqlen hints, causal / windows, softcap, scales (0, negative, large), sinks,
GQA / MQA, split-KV, packed GQA, built-in and callable score_mod / mask_mod, block lists,
strided inputs, outputs in place, the gradient of lse, deterministic runs (compared bit for bit)
and NaN in rows no sequence uses (which must not be read). Every case is rebuilt from its seed.

    python3 fuzz_reference.py --start S --count N [--budget SECONDS] [--out DIR]
    python3 fuzz_reference.py --seed S --verbose      # one case, with its details

A case's problems are "fail" (beyond the tolerances of conftest.py), "nondeterministic",
"shape" or an error; "tight" ones (beyond about one unit in the last place) are for information.
Known "fail"s that are not defects: values past the output dtype's range (fp16 gradients past
65504; a score_mod driving scores past 1e38, whose split-KV partial lse is inf in float32), and
score_mods with a kink that the reference's central differences straddle. test_reference_fuzz.py
runs a fixed range of seeds in the test suite.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuflash  # noqa: E402
from cuflash import mods  # noqa: E402
import attention_reference as ref  # noqa: E402
from conftest import TOLERANCE, numpy_dtype  # noqa: E402
from test_forward import split_full_and_mask  # noqa: E402

BLOCK = 128


# ----------------------------------------------------------------------------------------------
# random pieces


def rand_len(rng, allow_zero=True):
    r = rng.random()
    if r < 0.05 and allow_zero:
        return 0
    if r < 0.18:
        return 1
    if r < 0.55:
        return int(rng.integers(2, 33))
    if r < 0.85:
        return int(rng.integers(33, 161))
    return int(rng.integers(161, 301))


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(dtype))


def doc_ids(rng, batch, length):
    ids = np.zeros((batch, length), np.int32)
    for b in range(batch):
        ncut = int(rng.integers(0, 5))
        if length > 1 and ncut:
            cuts = np.sort(rng.choice(np.arange(1, length), size=min(ncut, length - 1), replace=False))
            ids[b] = np.searchsorted(cuts, np.arange(length), side="right")
    return ids


# score_mod callables: name -> factory(ctx) returning (callable, aux tuple for aux_tensors or None)
def score_mods(ctx):
    H, rng = ctx["H"], ctx["rng"]
    slopes = cuflash.scores.alibi_slopes(H)
    R = int(rng.integers(0, 6))
    table = rng.standard_normal((H, 2 * R + 1)).astype(np.float32)
    hscale = rng.uniform(0.25, 2.0, H).astype(np.float32)
    L = ctx["L"]
    bias = rng.standard_normal((ctx["B"], H, L)).astype(np.float32)
    return {
        "alibi_closure": (lambda s, b, h, q, kv: s + slopes[h] * (kv - q), None),
        "relative_table": (lambda s, b, h, q, kv: s + table[h, mods.clamp(kv - q, -R, R) + R], None),
        "tanh_cap": (lambda s, b, h, q, kv: 2.0 * mods.tanh(s / 2.0), None),
        "nonlinear": (lambda s, b, h, q, kv: s * mods.sigmoid(s) + 0.1 * mods.exp2(-abs(s + 0.3)) - 0.5, None),
        "where_branches": (lambda s, b, h, q, kv: mods.where(kv > q, s * 0.5, s + h * 0.25), None),
        "int_ops": (lambda s, b, h, q, kv: s - ((q // 4) % 3) * 0.1 + b * 0.2 - (kv - q) / 8, None),
        "neg_floordiv_mod": (lambda s, b, h, q, kv: s + ((kv - q) // 3) * 0.1 + ((kv - q) % 5) * 0.05, None),
        "square_div": (lambda s, b, h, q, kv: s ** 2 / 4.0 - s / (1.0 + (kv % 2)), None),
        "minus_inf_mask": (lambda s, b, h, q, kv: mods.where(kv <= q + 3, s, -math.inf), None),
        "min_max_log": (lambda s, b, h, q, kv: mods.maximum(s, -1.0) + mods.log(1.0 + mods.minimum(s * s, 4.0)),
                        None),
        "head_scale": (lambda s, b, h, q, kv: s * hscale[h], None),
        "aux_bias": (lambda s, b, h, q, kv, bias: s + bias[b, h, kv], (bias,)),
        "aux_two": (lambda s, b, h, q, kv, sl, bias: s + sl[h] * (kv - q) + bias[b, h, kv], (slopes, bias)),
        "exp_mix": (lambda s, b, h, q, kv: mods.exp(s * 0.25) - 1.0 + 3 ** (s * 0.1), None),
    }


def mask_mods(ctx):
    H, rng, B, L = ctx["H"], ctx["rng"], ctx["B"], ctx["L"]
    doc = doc_ids(rng, B, L)
    allowed = rng.random((H, L, L)) < 0.6
    return {
        "doc_causal": (lambda b, h, q, kv: (kv <= q) & (doc[b, q] == doc[b, kv])),
        "bool_table": (lambda b, h, q, kv: allowed[h, q, kv] & ~((h == 1) & (kv > q + 2))),
        "mod3": (lambda b, h, q, kv: (q + kv) % 3 != 0),
        "first_rows_empty": (lambda b, h, q, kv: (q >= 4) & (kv < q)),
        "bool_arith": (lambda b, h, q, kv: ((kv <= q) + (kv < 5)) * (q - kv < 9) + abs(kv == q)),
        "const_true": (lambda b, h, q, kv: True),
        "neg_floordiv": (lambda b, h, q, kv: (kv - q) // 4 == -1),
        "head_where": (lambda b, h, q, kv: mods.where(h % 2 == 0, kv <= q, kv >= q - 5)),
        "block_diag": (lambda b, h, q, kv: (q // 16) == (kv // 16)),
        "batch_dep": (lambda b, h, q, kv: kv < q + b * 3 + 1),
    }


# ----------------------------------------------------------------------------------------------
# case generation


def side_lengths(rng, c, side, batch, packed):
    """One side's (q or k) sequence capacities: packed, a length per sequence and a few padding
    rows past the last (lengths_<side>, pad_<side>); else one dense length (S<side>)."""
    if packed:
        caps = [rand_len(rng) for _ in range(batch)]
        c[f"lengths_{side}"] = caps
        c[f"pad_{side}"] = int(rng.integers(1, 6)) if rng.random() < 0.3 else 0
        return caps
    length = rand_len(rng)
    c["S" + side] = length
    return [length] * batch


def gen_case(seed):
    rng = np.random.default_rng(seed)
    c = {"seed": seed}
    dtype = "float16" if rng.random() < 0.7 else "bfloat16"
    c["dtype"] = dtype
    layout = rng.choice(["dense", "varlen", "paged"], p=[0.5, 0.3, 0.2])
    c["layout"] = str(layout)
    hkv = int(rng.choice([1, 1, 2, 2, 3, 4]))
    group = int(rng.choice([1, 1, 2, 3, 4, 6, 8]))
    while hkv * group > 12:
        group = max(1, group // 2)
    H = hkv * group
    D = int(rng.choice([32, 64, 32, 64, 16, 8, 128], p=[0.3, 0.3, 0.1, 0.1, 0.07, 0.06, 0.07]))
    Dv = D if rng.random() < 0.6 else int(rng.choice([32, 64, 16, 96]))
    c.update(H=H, Hkv=hkv, D=D, Dv=Dv)

    # --- layout
    if layout == "dense":
        B = int(rng.integers(1, 4)) if rng.random() > 0.01 else 0
        Sq = rand_len(rng)
        Sk = Sq if rng.random() < 0.3 else rand_len(rng)
        c.update(B=B, Sq=Sq, Sk=Sk)
        # seqused on dense tensors (through varlen_func / forward)
        c["seqused_q"] = [int(rng.integers(0, Sq + 1)) for _ in range(B)] if rng.random() < 0.12 else None
        c["seqused_k"] = [int(rng.integers(0, Sk + 1)) for _ in range(B)] if rng.random() < 0.12 else None
        caps_q, caps_k = [Sq] * B, [Sk] * B
    elif layout == "varlen":
        B = int(rng.integers(1, 5))
        c["B"] = B
        c["q_packed"] = bool(rng.random() < 0.85)
        c["k_packed"] = bool(rng.random() < 0.85)
        if not c["q_packed"] and not c["k_packed"]:
            c["q_packed"] = True
        caps_q = side_lengths(rng, c, "q", B, c["q_packed"])
        caps_k = side_lengths(rng, c, "k", B, c["k_packed"])
        c["seqused_q"] = [int(rng.integers(0, n + 1)) for n in caps_q] if rng.random() < 0.25 else None
        c["seqused_k"] = [int(rng.integers(0, n + 1)) for n in caps_k] if rng.random() < 0.25 else None
        # max_seqlen hints: None, exact, or larger
        def hint(caps, packed):
            if not packed:
                return None
            r = rng.random()
            if r < 0.4:
                return None
            if r < 0.8:
                return max(caps) if caps else 0
            return max(caps) + int(rng.integers(1, 140)) if caps else 5
        c["max_seqlen_q"] = hint(caps_q, c["q_packed"])
        c["max_seqlen_k"] = hint(caps_k, c["k_packed"])
        if c["max_seqlen_q"] is None and c["max_seqlen_k"] is None and rng.random() < 0.5:
            pass
    else:  # paged
        B = int(rng.integers(1, 4))
        c["B"] = B
        ps = int(rng.choice([1, 2, 5, 8, 16, 32, 64, 128]))
        lens = [rand_len(rng) for _ in range(B)]
        max_pages = max(1, -(-max(lens) // ps) + int(rng.integers(0, 2)))
        while max_pages * ps > 400:
            max_pages -= 1
        max_pages = max(max_pages, 1)
        c.update(page_size=ps, max_pages=max_pages)
        cap = max_pages * ps
        c["seqused_k"] = [min(n, cap) for n in lens] if rng.random() < 0.75 else None
        num_pages = B * max_pages + int(rng.integers(0, 4))
        c["num_pages"] = num_pages
        c["share_pages"] = bool(rng.random() < 0.2)
        c["q_packed"] = bool(rng.random() < 0.3)
        caps_q = side_lengths(rng, c, "q", B, c["q_packed"])
        if c["q_packed"]:
            c["max_seqlen_q"] = max(caps_q) if rng.random() < 0.5 else None
        c["seqused_q"] = None
        caps_k = [cap] * B
    c["caps_q"], c["caps_k"] = caps_q, caps_k

    # bound the work
    work = sum(cq * ck for cq, ck in zip(caps_q, caps_k)) * H * max(D, Dv)
    if work > 6e7:
        return None

    # --- options
    c["causal"] = bool(rng.random() < 0.35)
    if rng.random() < 0.4:
        def side(options):
            v = options[int(rng.integers(0, len(options)))]
            return v
        left = side([None, -1, 0, 1, 2, int(rng.integers(3, 40)), int(rng.integers(40, 400)), 2**31 - 1])
        right = side([None, -1, 0, 1, int(rng.integers(2, 40)), int(rng.integers(40, 400)), 2**31 - 1])
        c["window"] = (left, right)
    else:
        c["window"] = None
    c["softcap"] = float(rng.choice([0.5, 2.0, 5.0, 30.0])) if rng.random() < 0.2 else 0.0
    c["scale"] = (float(rng.choice([0.0, 1e-3, 0.05, 0.3, 1.0, 3.0, 10.0, 40.0, -0.5, 1e3]))
                  if rng.random() < 0.4 else None)
    c["sink"] = str(rng.choice(["float32", "bfloat16", "float16"])) if rng.random() < 0.25 else None
    c["sink_scale"] = float(rng.choice([1.0, 2.0, 10.0]))
    c["input_scale"] = float(rng.choice([1.0, 1.0, 1.0, 3.0, 0.2]))
    r = rng.random()
    if r < 0.12:
        c["score_mod"] = ("alibi", bool(rng.random() < 0.3))  # (kind, via aux_tensors)
    elif r < 0.22:
        c["score_mod"] = ("relative_bias", bool(rng.random() < 0.3))
    elif r < 0.36:
        names = ["alibi_closure", "relative_table", "tanh_cap", "nonlinear", "where_branches", "int_ops",
                 "neg_floordiv_mod", "square_div", "minus_inf_mask", "min_max_log", "head_scale", "aux_bias",
                 "aux_two", "exp_mix"]
        c["score_mod"] = ("callable", names[int(rng.integers(0, len(names)))])
    else:
        c["score_mod"] = None
    r = rng.random()
    if r < 0.06:
        c["mask_mod"] = ("causal",)
    elif r < 0.12:
        c["mask_mod"] = ("sliding_window", int(rng.integers(0, 40)), int(rng.integers(0, 40)))
    elif r < 0.17:
        c["mask_mod"] = ("prefix_lm", int(rng.integers(0, 60)))
    elif r < 0.23:
        c["mask_mod"] = ("document", bool(rng.random() < 0.3))
    elif r < 0.35:
        names = ["doc_causal", "bool_table", "mod3", "first_rows_empty", "bool_arith", "const_true",
                 "neg_floordiv", "head_where", "block_diag", "batch_dep"]
        c["mask_mod"] = ("callable", names[int(rng.integers(0, len(names)))])
    else:
        c["mask_mod"] = None
    # aux_tensors cannot serve both a built-in score_mod and a built-in document via aux
    if (c["score_mod"] and c["score_mod"][0] in ("alibi", "relative_bias") and c["score_mod"][1]
            and c["mask_mod"] and c["mask_mod"][0] == "document" and c["mask_mod"][1]):
        c["mask_mod"] = ("document", False)
    if c["score_mod"] and c["score_mod"][0] == "callable" and c["score_mod"][1] in ("aux_bias", "aux_two") \
            and c["mask_mod"] and c["mask_mod"][0] == "document" and c["mask_mod"][1]:
        c["mask_mod"] = ("document", False)
    if c["score_mod"] and c["score_mod"][0] == "callable" and c["score_mod"][1] in ("aux_bias", "aux_two") \
            and c["mask_mod"] and c["mask_mod"][0] == "callable":
        c["mask_mod"] = None  # callables would share aux_tensors as trailing parameters
    r = rng.random()
    c["blocks"] = None
    if r < 0.18:
        c["blocks"] = str(rng.choice(["create", "random"]))
        c["blocks_heads"] = int(rng.choice([1, H]))
        c["blocks_batch1"] = bool(rng.random() < 0.3)
        c["q_lists"] = bool(rng.random() < 0.25)
    c["num_splits"] = int(rng.choice([1, 1, 1, 0, -1, 2, 3, 5, 17]))
    c["pack_gqa"] = [None, False, True][int(rng.integers(0, 3))]
    c["deterministic"] = bool(rng.random() < 0.3)
    c["backward"] = bool(rng.random() < 0.85)
    c["dlse"] = bool(rng.random() < 0.4)
    c["nan_padding"] = bool(rng.random() < 0.3)  # NaN in dout/dlse rows no sequence uses
    c["strided"] = bool(rng.random() < 0.3)  # q, k, v, dout as strided views
    c["prealloc"] = bool(rng.random() < 0.25)  # strided preallocated out/lse (forward api) and dq/dk/dv
    c["sink_special"] = bool(rng.random() < 0.2)  # a head's sink -inf, another large
    c["nan_inputs"] = bool(rng.random() < 0.25)  # NaN in q/k/v rows no sequence uses
    c["pt_garbage"] = bool(layout == "paged" and rng.random() < 0.15)  # page-table slots past seqused_k = -1

    # --- api
    needs_mask = c["mask_mod"] is not None or c["blocks"] is not None
    needs_score = c["score_mod"] is not None
    if layout == "dense" and c["seqused_q"] is None and c["seqused_k"] is None:
        if needs_score and needs_mask:
            api = "forward"
        elif needs_score:
            api = str(rng.choice(["forward", "varlen_func"]))
        elif needs_mask:
            api = str(rng.choice(["forward", "func"]))
        else:
            api = str(rng.choice(["forward", "func", "varlen_func"]))
    else:
        api = "forward" if needs_mask else str(rng.choice(["forward", "varlen_func"]))
    c["api"] = api
    c["data_seed"] = int(rng.integers(0, 2**31))
    return c


# ----------------------------------------------------------------------------------------------
# building arrays


def build_q(rng, c, packed, dtype, scale, kw, qmap):
    """q of a varlen or paged case: packed with cu_seqlens_q (into kw) and padding rows past the
    last sequence, or dense; qmap gets each sequence's storage rows."""
    batch, heads, dim = c["B"], c["H"], c["D"]
    if packed:
        cu_q = np.concatenate([[0], np.cumsum(c["lengths_q"])]).astype(np.int32)
        kw["cu_seqlens_q"] = cu_q
        qmap.extend(np.arange(cu_q[b], cu_q[b + 1]) for b in range(batch))
        return randn(rng, (int(cu_q[-1]) + c["pad_q"], heads, dim), dtype, scale)
    qmap.extend(np.arange(c["Sq"]) + b * c["Sq"] for b in range(batch))
    return randn(rng, (batch, c["Sq"], heads, dim), dtype, scale)


def build(c):
    rng = np.random.default_rng(c["data_seed"])
    dtype, H, Hkv, D, Dv, B = c["dtype"], c["H"], c["Hkv"], c["D"], c["Dv"], c["B"]
    s = c["input_scale"]
    kw = {}
    layout = c["layout"]
    # flat row maps: per sequence, the storage rows of its q tokens / k tokens (capacity)
    qmap, kmap = [], []
    if layout == "dense":
        q = randn(rng, (B, c["Sq"], H, D), dtype, s)
        k = randn(rng, (B, c["Sk"], Hkv, D), dtype, s)
        v = randn(rng, (B, c["Sk"], Hkv, Dv), dtype)
        for b in range(B):
            qmap.append(np.arange(c["Sq"]) + b * c["Sq"])
            kmap.append(np.arange(c["Sk"]) + b * c["Sk"])
        q_packed = False
        k_rows_total = B * c["Sk"]
        k_kind = "dense"
    elif layout == "varlen":
        q_packed = c["q_packed"]
        q = build_q(rng, c, q_packed, dtype, s, kw, qmap)
        if c["k_packed"]:
            cu_k = np.concatenate([[0], np.cumsum(c["lengths_k"])]).astype(np.int32)
            k = randn(rng, (int(cu_k[-1]) + c["pad_k"], Hkv, D), dtype, s)
            v = randn(rng, (int(cu_k[-1]) + c["pad_k"], Hkv, Dv), dtype)
            kw["cu_seqlens_k"] = cu_k
            for b in range(B):
                kmap.append(np.arange(cu_k[b], cu_k[b + 1]))
            k_rows_total = k.shape[0]
            k_kind = "packed"
        else:
            k = randn(rng, (B, c["Sk"], Hkv, D), dtype, s)
            v = randn(rng, (B, c["Sk"], Hkv, Dv), dtype)
            for b in range(B):
                kmap.append(np.arange(c["Sk"]) + b * c["Sk"])
            k_rows_total = B * c["Sk"]
            k_kind = "dense"
        if c.get("max_seqlen_q") is not None:
            kw["max_seqlen_q"] = c["max_seqlen_q"]
        if c.get("max_seqlen_k") is not None:
            kw["max_seqlen_k"] = c["max_seqlen_k"]
    else:
        ps, mp, npg = c["page_size"], c["max_pages"], c["num_pages"]
        k = randn(rng, (npg, ps, Hkv, D), dtype, s)
        v = randn(rng, (npg, ps, Hkv, Dv), dtype)
        if c["share_pages"]:
            pt = rng.integers(0, npg, size=(B, mp)).astype(np.int32)
        else:
            pt = rng.permutation(npg)[: B * mp].reshape(B, mp).astype(np.int32)
        kw["page_table"] = pt
        for b in range(B):
            pos = np.arange(mp * ps)
            kmap.append(pt[b][pos // ps] * ps + pos % ps)
        k_rows_total = npg * ps
        k_kind = "paged"
        q_packed = c["q_packed"]
        q = build_q(rng, c, q_packed, dtype, s, kw, qmap)
        if c.get("max_seqlen_q") is not None:
            kw["max_seqlen_q"] = c["max_seqlen_q"]
    if c.get("seqused_q") is not None:
        kw["seqused_q"] = np.array(c["seqused_q"], np.int32)
    if c.get("seqused_k") is not None:
        kw["seqused_k"] = np.array(c["seqused_k"], np.int32)
    used_q = c["seqused_q"] if c.get("seqused_q") is not None else [len(m) for m in qmap]
    used_k = c["seqused_k"] if c.get("seqused_k") is not None else [len(m) for m in kmap]

    opts = ref.Options()
    if c["causal"]:
        kw["causal"] = True
        opts.causal = True
    if c["window"] is not None:
        kw["window_size"] = tuple(c["window"])
        opts.window = tuple(None if x is None or x < 0 else x for x in c["window"])
    if c["softcap"]:
        kw["softcap"] = c["softcap"]
        opts.softcap = c["softcap"]
    if c["scale"] is not None:
        kw["softmax_scale"] = c["scale"]
        opts.scale = c["scale"]
    if c["sink"] is not None:
        sink = (rng.standard_normal(H) * c["sink_scale"]).astype(numpy_dtype(c["sink"]))
        kw["learnable_sink"] = sink
        if c.get("sink_special") and H >= 2:
            sink[0] = -np.inf
            sink[H - 1] = 25.0
        opts.sink = sink

    # longest lengths as the lists / doc ids count them
    if q_packed:
        Lq = kw.get("max_seqlen_q", max(c["caps_q"]) if c["caps_q"] else 0)
    else:
        Lq = q.shape[1]
    if k_kind == "packed":
        Lk = kw.get("max_seqlen_k", max(c["caps_k"]) if c["caps_k"] else 0)
    elif k_kind == "paged":
        Lk = c["max_pages"] * c["page_size"]
    else:
        Lk = k.shape[1]
    L = max(Lq, Lk, max(c["caps_q"] + [0]), max(c["caps_k"] + [0]), 1) + int(rng.integers(0, 3))
    ctx = {"H": H, "B": B, "L": L, "rng": np.random.default_rng(c["data_seed"] + 1)}

    aux_tensors = None
    sm = c["score_mod"]
    if sm is not None:
        if sm[0] == "alibi":
            slopes = (cuflash.scores.alibi_slopes(H) * np.random.default_rng(c["data_seed"] + 2).uniform(0.5, 2, H)
                      ).astype(np.float32)
            if sm[1]:
                kw["score_mod"] = cuflash.scores.alibi()
                aux_tensors = [slopes]
            else:
                kw["score_mod"] = cuflash.scores.alibi(slopes)
            opts.score_bias = lambda b, h, i, j, s_=slopes: s_[h] * (j - i)
        elif sm[0] == "relative_bias":
            r2 = np.random.default_rng(c["data_seed"] + 3)
            R = int(r2.integers(0, 8))
            table = r2.standard_normal((H, 2 * R + 1)).astype(np.float32)
            if sm[1]:
                kw["score_mod"] = cuflash.scores.relative_bias()
                aux_tensors = [table]
            else:
                kw["score_mod"] = cuflash.scores.relative_bias(table)
            opts.score_bias = lambda b, h, i, j, t=table, R=R: t[h, np.clip(j - i, -R, R) + R]
        else:
            fn, aux = score_mods(ctx)[sm[1]]
            kw["score_mod"] = fn
            opts.score_mod = fn
            if aux is not None:
                aux_tensors = list(aux)
                opts.aux = tuple(aux)
    mm = c["mask_mod"]
    mask_for_lists = None
    if mm is not None:
        if mm[0] == "causal":
            kw["mask_mod"] = cuflash.masks.causal()
            opts.mask = lambda b, i, j: j <= i
        elif mm[0] == "sliding_window":
            kw["mask_mod"] = cuflash.masks.sliding_window(mm[1], mm[2])
            opts.mask = lambda b, i, j, l=mm[1], r=mm[2]: (j >= i - l) & (j <= i + r)
        elif mm[0] == "prefix_lm":
            kw["mask_mod"] = cuflash.masks.prefix_lm(mm[1])
            opts.mask = lambda b, i, j, n=mm[1]: (j <= i) | (j < n)
        elif mm[0] == "document":
            doc = doc_ids(np.random.default_rng(c["data_seed"] + 4), B, L)
            if mm[1] and aux_tensors is None and c["api"] != "func":
                kw["mask_mod"] = cuflash.masks.document()
                aux_tensors = [doc]
            else:
                kw["mask_mod"] = cuflash.masks.document(doc)
            opts.mask = lambda b, i, j, d=doc: d[b][i] == d[b][j]
        else:
            fn = mask_mods(ctx)[mm[1]]
            kw["mask_mod"] = fn
            opts.mask_mod = fn
        mask_for_lists = kw["mask_mod"]
    if aux_tensors is not None:
        kw["aux_tensors"] = aux_tensors

    lists = None
    if c["blocks"] is not None and Lq > 0 and Lk > 0 and B > 0:
        lr = np.random.default_rng(c["data_seed"] + 5)
        rows, cols = -(-Lq // BLOCK), -(-Lk // BLOCK)
        hb = c["blocks_heads"]
        bb = 1 if c["blocks_batch1"] else B
        use_create = (c["blocks"] == "create" and mask_for_lists is not None
                      and not (isinstance(mask_for_lists, cuflash.masks.MaskMod) and mask_for_lists.name == "document"
                               and not mask_for_lists.aux))
        if use_create:
            if callable(mask_for_lists) and not isinstance(mask_for_lists, cuflash.masks.MaskMod):
                fc, fi, mc, mi = cuflash.block_sparse.create_block_mask(
                    mask_for_lists, None if bb == 1 else B, None if hb == 1 else H, Lq, Lk)
            else:
                fc, fi, mc, mi = cuflash.block_sparse.create_block_mask(mask_for_lists, None if bb == 1 else B,
                                                                        None, Lq, Lk)
        else:
            cnt = np.zeros((bb, hb, rows), np.int32)
            idx = np.zeros((bb, hb, rows, cols), np.int32)
            dens = lr.uniform(0.3, 1.0)
            for bi in range(bb):
                for h in range(hb):
                    for m in range(rows):
                        ch = np.flatnonzero(lr.random(cols) < dens)
                        cnt[bi, h, m] = len(ch)
                        idx[bi, h, m, : len(ch)] = lr.permutation(ch)
            fc, fi, mc, mi = split_full_and_mask(lr, cnt, idx)
        lists = (fc, fi, mc, mi)
        kw.update(full_block_cnt=fc, full_block_idx=fi, mask_block_cnt=mc, mask_block_idx=mi)
        fcb, fib, mcb, mib = (np.broadcast_to(x, (B,) + x.shape[1:]) for x in lists)
        opts.blocks = ref.block_masks((fcb, fib), (mcb, mib), max(Lq, 1), max(Lk, 1))
    if c["num_splits"] != 1:
        kw["num_splits"] = c["num_splits"]
    if c["pack_gqa"] is not None:
        kw["pack_gqa"] = c["pack_gqa"]
    if c["deterministic"]:
        kw["deterministic"] = True
    if c.get("pt_garbage") and c.get("seqused_k") is not None:
        pt = kw["page_table"].copy()
        for b in range(B):
            need = -(-int(c["seqused_k"][b]) // c["page_size"])
            pt[b, need:] = -1
        kw["page_table"] = pt
    if c.get("nan_inputs"):
        qf = q.reshape((-1,) + q.shape[-2:])
        kf = k.reshape((-1,) + k.shape[-2:])
        vf = v.reshape((-1,) + v.shape[-2:])
        used_rows_q = np.zeros(qf.shape[0], bool)
        used_rows_k = np.zeros(kf.shape[0], bool)
        for b in range(B):
            used_rows_q[qmap[b][: int(used_q[b])]] = True
            used_rows_k[kmap[b][: int(used_k[b])]] = True
        qf[~used_rows_q] = np.nan
        kf[~used_rows_k] = np.nan
        vf[~used_rows_k] = np.nan
    if c.get("strided"):
        sr = np.random.default_rng(c["data_seed"] + 9)
        q, k, v = strided(sr, q), strided(sr, k), strided(sr, v)
    out_shape = (q.shape[0], H, Dv) if q_packed else (q.shape[0], q.shape[1], H, Dv)
    lse_shape = (H, q.shape[0]) if q_packed else (q.shape[0], H, q.shape[1])
    return dict(out_shape=out_shape, lse_shape=lse_shape, q=q, k=k, v=v, kw=kw, opts=opts, qmap=qmap, kmap=kmap, used_q=used_q, used_k=used_k,
                q_packed=q_packed, k_kind=k_kind, k_rows_total=k_rows_total, lists=lists, Lq=Lq, Lk=Lk)


def strided(rng, a, fill=None):
    """A copy of `a` as a view with other strides (last dimension contiguous)."""
    mode = rng.integers(0, 2)
    if a.ndim >= 3 and mode == 0:
        # permute the two dims before the last
        perm = list(range(a.ndim))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        base = np.empty(tuple(a.shape[i] for i in perm), a.dtype)
        view = base.transpose(perm)
    else:
        base = np.empty(a.shape[:-1] + (a.shape[-1] + 8,), a.dtype)
        view = base[..., : a.shape[-1]]
        base[..., a.shape[-1]:] = 3
    if fill is None:
        view[...] = a
    else:
        view[...] = fill
    return view


FWD_ONLY = ("num_splits", "pack_gqa")


def call_forward(c, x):
    q, k, v, kw = x["q"], x["k"], x["v"], dict(x["kw"])
    api = c["api"]
    if api == "func":
        return cuflash.flash_attn_func(q, k, v, **kw)
    if api == "varlen_func":
        return cuflash.flash_attn_varlen_func(q, k, v, **kw)
    kw.pop("deterministic", None)
    if c.get("prealloc"):
        pr = np.random.default_rng(c["data_seed"] + 10)
        ref_out, ref_lse = x["out_shape"], x["lse_shape"]
        out = strided(pr, np.empty(ref_out, q.dtype), fill=7)
        lse = strided(pr, np.empty(ref_lse, np.float32), fill=5)
        r_out, r_lse = cuflash.flash_attn_forward(q, k, v, out=out, lse=lse, **kw)
        assert r_out is out and r_lse is lse
        return out, lse
    return cuflash.flash_attn_forward(q, k, v, return_lse=True, **kw)


def call_backward(c, x, dout, out, lse, dlse):
    kw = {key: val for key, val in x["kw"].items() if key not in FWD_ONLY}
    if x["lists"] is not None and c.get("q_lists"):
        fc, fi, mc, mi = x["lists"]
        cols = fi.shape[3]
        qfc, qfi = cuflash.block_sparse.transpose_block_lists(fc, fi, cols)
        qmc, qmi = cuflash.block_sparse.transpose_block_lists(mc, mi, cols)
        kw.update(q_full_block_cnt=qfc, q_full_block_idx=qfi, q_mask_block_cnt=qmc, q_mask_block_idx=qmi)
    if dlse is not None:
        kw["dlse"] = dlse
    if c.get("prealloc"):
        pr = np.random.default_rng(c["data_seed"] + 11)
        for name, t in (("dq", x["q"]), ("dk", x["k"]), ("dv", x["v"])):
            kw[name] = strided(pr, np.empty(t.shape, t.dtype), fill=9)
        g = cuflash.flash_attn_backward(dout, x["q"], x["k"], x["v"], out, lse, **kw)
        assert g[0] is kw["dq"] and g[1] is kw["dk"] and g[2] is kw["dv"]
        return g
    return cuflash.flash_attn_backward(dout, x["q"], x["k"], x["v"], out, lse, **kw)


# ----------------------------------------------------------------------------------------------
# reference on flat rows


def flat_rows(t, packed):
    return t if packed else t.reshape((-1,) + t.shape[2:])


def lse_rows(lse, packed):
    # (B, H, Sq) -> (B*Sq, H); (H, total) -> (total, H)
    if packed:
        return lse.T
    return lse.transpose(0, 2, 1).reshape(-1, lse.shape[1])


def reference(c, x, dout=None, out=None, dlse=None):
    q, k, v, opts = x["q"], x["k"], x["v"], x["opts"]
    qf, kf, vf = flat_rows(q, x["q_packed"]), flat_rows(k, x["k_kind"] == "packed"), None
    if x["k_kind"] == "paged":
        kf = k.reshape((-1,) + k.shape[2:])
        vf = v.reshape((-1,) + v.shape[2:])
    else:
        vf = flat_rows(v, x["k_kind"] == "packed")
    H, Dv = c["H"], c["Dv"]
    nq = qf.shape[0]
    out_e = np.zeros((nq, H, Dv))
    lse_e = np.full((nq, H), 0.0 if x["q_packed"] else -np.inf)
    cat_q = np.full(nq, 2 if x["q_packed"] else 1, np.int8)  # 0 used, 1 unused-in-seq, 2 padding
    dq_e = dk_e = dv_e = d_sink = None
    if dout is not None:
        doutf = flat_rows(dout, x["q_packed"])
        outf = flat_rows(out, x["q_packed"])
        dlsef = None if dlse is None else lse_rows(dlse, x["q_packed"])
        dq_e = np.zeros(qf.shape)
        dk_e = np.zeros(kf.shape)
        dv_e = np.zeros(vf.shape)
        d_sink = None if opts.sink is None else np.zeros(H)
    nk = kf.shape[0]
    cat_k = np.full(nk, 2 if x["k_kind"] == "packed" else 1, np.int8)
    for b in range(c["B"]):
        qm, km = x["qmap"][b], x["kmap"][b]
        uq, uk = int(x["used_q"][b]), int(x["used_k"][b])
        qrows, krows = qm[:uq], km[:uk]
        lse_e[qm] = -np.inf
        cat_q[qm] = 1
        cat_q[qrows] = 0
        cat_k[km] = np.minimum(cat_k[km], 1)
        cat_k[krows] = 0
        o, l = ref.forward_one(qf[qrows], kf[krows], vf[krows], b, opts)
        out_e[qrows] = o
        lse_e[qrows] = l.T
        if dout is not None:
            dlb = None if dlsef is None else dlsef[qrows].T
            g = ref.backward_one(doutf[qrows], qf[qrows], kf[krows], vf[krows], outf[qrows], b, opts, dlb)
            dq_e[qrows] = g[0]
            np.add.at(dk_e, krows, g[1])
            np.add.at(dv_e, krows, g[2])
            if d_sink is not None:
                d_sink += g[3]
    return dict(out=out_e, lse=lse_e, cat_q=cat_q, cat_k=cat_k, dq=dq_e, dk=dk_e, dv=dv_e, d_sink=d_sink)


# ----------------------------------------------------------------------------------------------
# comparisons


TIGHT_RTOL = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


@np.errstate(all="ignore")
def compare(name, actual, expected, dtype, scale=1.0, cats=None, tight=True):
    """Returns a list of problems (dicts)."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected, dtype=np.float64)
    problems = []
    if a.shape != e.shape:
        return [dict(what=name, kind="shape", actual=str(a.shape), expected=str(e.shape))]
    atol, rtol = TOLERANCE[dtype]
    both_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    err = np.where(both_inf, 0.0, np.abs(a - e))
    err = np.where(np.isnan(a) | np.isnan(e), np.inf, err)
    bound = atol * scale + rtol * np.abs(np.where(both_inf, 0.0, e))
    tbound = 1e-5 * scale + TIGHT_RTOL[dtype] * np.abs(np.where(both_inf, 0.0, e))
    for label, bnd, kind in (("tol", bound, "fail"), ("tight", tbound, "tight")):
        if kind == "tight" and not tight:
            continue
        bad = ~(err <= bnd)
        if bad.any():
            if cats is not None:
                rowcat = np.broadcast_to(cats.reshape((-1,) + (1,) * (a.ndim - 1)), a.shape)
                cat_names = sorted(set({0: "used", 1: "unused", 2: "padding"}[int(x)] for x in rowcat[bad]))
            else:
                cat_names = []
            w = np.unravel_index(np.argmax(np.where(bad, err - np.where(np.isfinite(bnd), bnd, 0), -1)), a.shape)
            problems.append(dict(what=name, kind=kind, count=int(bad.sum()), total=int(a.size), where=[int(i) for i in w],
                                 actual=float(a[w]), expected=float(e[w]), err=float(err[w]), cats=cat_names))
            if kind == "fail":
                break
    return problems


@np.errstate(all="ignore")
def compare_lse(actual, expected, cats):
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    problems = []
    if a.shape != e.shape:
        return [dict(what="lse", kind="shape", actual=str(a.shape), expected=str(e.shape))]
    rowcat = np.broadcast_to(cats[:, None], a.shape)
    bad = np.isnan(a) | (np.isneginf(a) != np.isneginf(e)) | (np.isposinf(a) != np.isposinf(e))
    fin = np.isfinite(e) & np.isfinite(a)
    bad |= fin & ~(np.abs(a - e) <= 1e-4 + 1e-4 * np.abs(e))
    names = {0: "used", 1: "unused", 2: "padding"}
    if bad.any():
        w = np.unravel_index(np.argmax(bad), a.shape)
        problems.append(dict(what="lse", kind="fail", count=int(bad.sum()), total=int(a.size), where=[int(i) for i in w],
                             actual=float(a[w]), expected=float(e[w]),
                             cats=sorted(set(names[int(x)] for x in rowcat[bad]))))
    else:
        tb = fin & ~(np.abs(a - e) <= 2e-6 + 3e-7 * np.abs(e))
        if tb.any():
            w = np.unravel_index(np.argmax(np.where(tb, np.abs(a - e), -1)), a.shape)
            problems.append(dict(what="lse", kind="tight", count=int(tb.sum()), total=int(a.size), where=[int(i) for i in w],
                                 actual=float(a[w]), expected=float(e[w]),
                                 cats=sorted(set(names[int(x)] for x in rowcat[tb]))))
    return problems


def run_case(seed, verbose=False):
    c = gen_case(seed)
    if c is None:
        return None
    t0 = time.time()
    x = build(c)
    res = dict(seed=seed, case={k: v for k, v in c.items() if k not in ("caps_q", "caps_k")}, problems=[],
               error=None)
    try:
        out, lse = call_forward(c, x)
    except Exception as err:  # noqa: BLE001
        res["error"] = f"forward: {type(err).__name__}: {err}"
        res["time"] = time.time() - t0
        return res
    dtype = c["dtype"]
    dout = dlse = None
    if c["backward"]:
        rng = np.random.default_rng(c["data_seed"] + 7)
        dout = randn(rng, out.shape, dtype)
        if c.get("strided"):
            dout = strided(np.random.default_rng(c["data_seed"] + 12), dout)
        if c["dlse"]:
            dlse = rng.standard_normal(lse.shape).astype(np.float32)
            dlse[np.isneginf(lse)] = np.nan
    r = reference(c, x, dout, out, dlse) if c["backward"] else reference(c, x)
    qp = x["q_packed"]
    if c["backward"] and c["nan_padding"]:
        # rows no sequence uses: their dout / dlse must not be read
        unused = r["cat_q"] != 0
        if qp:
            dout[unused] = np.nan
            if dlse is not None:
                dlse[:, unused] = np.nan
        else:
            um = unused.reshape(dout.shape[0], dout.shape[1])
            dout[um] = np.nan
            if dlse is not None:
                dlse[np.broadcast_to(um[:, None, :], dlse.shape)] = np.nan
    if c.get("prealloc") and c["api"] == "forward":
        r["out"][r["cat_q"] == 2] = 7
        r["lse"][r["cat_q"] == 2] = 5
    if c.get("prealloc") and c["backward"]:
        r["dq"][r["cat_q"] == 2] = 9
        r["dk"][r["cat_k"] == 2] = 9
        r["dv"][r["cat_k"] == 2] = 9
    res["problems"] += compare("out", flat_rows(out, qp), r["out"], dtype, cats=r["cat_q"])
    res["problems"] += compare_lse(lse_rows(lse, qp), r["lse"], r["cat_q"])
    if c["backward"]:
        try:
            grads = call_backward(c, x, dout, out, lse, dlse)
            if c["deterministic"]:
                grads2 = call_backward(c, x, dout, out, lse, dlse)
                for nm, g1, g2 in zip(("dq", "dk", "dv", "d_sink"), grads, grads2):
                    if g1 is not None and not np.array_equal(np.asarray(g1), np.asarray(g2), equal_nan=True):
                        res["problems"].append(dict(what=nm, kind="nondeterministic"))
        except Exception as err:  # noqa: BLE001
            res["error"] = f"backward: {type(err).__name__}: {err}"
            res["time"] = time.time() - t0
            return res
        # recompute the reference with NaN-free dout (NaNs only in unused rows)
        kp = x["k_kind"] == "packed"
        for nm, g, e, cats, packed in (("dq", grads[0], r["dq"], r["cat_q"], qp),
                                       ("dk", grads[1], r["dk"], r["cat_k"], kp),
                                       ("dv", grads[2], r["dv"], r["cat_k"], kp)):
            if x["k_kind"] == "paged" and nm != "dq":
                gf = np.asarray(g).reshape((-1,) + g.shape[2:])
            else:
                gf = flat_rows(g, packed)
            scale = max(1.0, float(np.abs(e).max())) if e.size else 1.0
            res["problems"] += compare(nm, gf, e, dtype, scale=scale, cats=cats)
        if r["d_sink"] is not None:
            ds = grads[3]
            e = r["d_sink"]
            scale = max(1.0, float(np.abs(e).max()))
            if ds is None or np.isnan(np.asarray(ds, np.float64)).any() or not np.allclose(
                    np.asarray(ds, np.float64), e, atol=2e-3 * scale, rtol=1e-2):
                res["problems"].append(dict(what="d_sink", kind="fail",
                                            actual=None if ds is None else [float(v) for v in ds],
                                            expected=[float(v) for v in e]))
            elif not np.allclose(np.asarray(ds, np.float64), e, atol=1e-6 * scale, rtol=1e-5):
                res["problems"].append(dict(what="d_sink", kind="tight",
                                            actual=[float(v) for v in ds], expected=[float(v) for v in e]))
        elif grads[3] is not None:
            res["problems"].append(dict(what="d_sink", kind="fail", actual="not None", expected=None))
    res["time"] = time.time() - t0
    if verbose:
        print(json.dumps(res, indent=1, default=str))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--budget", type=float, default=1e9)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default="fuzz_results")
    a = ap.parse_args()
    if a.seed is not None:
        run_case(a.seed, verbose=True)
        return
    os.makedirs(a.out, exist_ok=True)
    t_end = time.time() + a.budget
    log = open(os.path.join(a.out, f"results_{a.start}.jsonl"), "a")
    progress = os.path.join(a.out, "current_seed")
    for seed in range(a.start, a.start + a.count):
        if time.time() > t_end:
            break
        with open(progress, "w") as f:
            f.write(str(seed))
        try:
            res = run_case(seed)
        except Exception as err:  # noqa: BLE001  (a bug in the harness or the reference)
            res = dict(seed=seed, harness_error=f"{type(err).__name__}: {err}", tb=traceback.format_exc())
        if res is None:
            continue
        log.write(json.dumps(res, default=str) + "\n")
        log.flush()


if __name__ == "__main__":
    main()
