"""Triton kernel for :func:`fastgen.ops.attention.shared_kv_attention`: decode and small ``q``.

Why a kernel: in beam search the ``G`` hypotheses of an input attend to the same keys and values
(encoder states, a shared prompt). Per-hypothesis attention streams that K/V from memory ``G``
times (and ``H/Hkv`` more when GQA heads are repeated). Here one program owns an (input, kv
head) pair, a block of its query rows and a range of keys, and serves all ``G * H/Hkv * q``
query rows of that pair from each K/V tile it loads: K/V is read once per input, which is what
bounds decode time.

Design (flash-decoding): scores and softmax in float32 with an online, ``-inf``-safe softmax;
the key axis may be split across programs when (input, kv head) pairs alone cannot fill the GPU,
and a second kernel merges the splits by their log-sum-exp. Query row ``m`` of a program is
``(g, r, i)`` with ``m = (g * H/Hkv + r) * q + i``: hypothesis ``b*G + g``, head
``kv_head * H/Hkv + r``, query position ``i``.

Layers: kernels -> :func:`shared_kv_attention` (launcher) -> :func:`not_supported_reasons` (what
the dispatcher in :mod:`fastgen.ops.attention` asks before choosing this backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["not_supported_reasons", "shared_kv_attention"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # larger heads would need tiles too small for the tensor cores to fit in registers
MIN_BLOCKS_PER_SPLIT = 4  # a split that reads fewer key blocks costs more to merge than it saves


@triton.jit
def _row_coordinates(
    pid_bh,
    pid_m,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Hypothesis, head and query position of each row of this program's block (int64: no overflow)."""
    batch_index = (pid_bh // KV_HEADS).to(tl.int64)
    kv_head = pid_bh % KV_HEADS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * HEAD_GROUP * Q_LEN
    g = offs_m // (HEAD_GROUP * Q_LEN)
    head = kv_head * HEAD_GROUP + (offs_m // Q_LEN) % HEAD_GROUP
    qi = offs_m % Q_LEN
    return batch_index, kv_head, offs_m, row_ok, g, batch_index * GROUP + g, head, qi


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """fp32-accumulating ``a @ b``; ``UPCAST`` works around the interpreter's bf16 ``tl.dot``, which
    multiplies raw bit patterns (triton-lang/triton#11584, "not supported yet").

    bf16 products are exact in fp32, so the upcast changes only the summation order, not the
    rounding of the operands: the interpreted kernel still tests the GPU kernel's numerics.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # ieee: no TF32 for fp32 inputs; documented as ignored otherwise


@triton.jit
def _shared_kv_attention_kernel(
    Q,
    K,
    V,
    Mask,
    Out,
    Lse,
    RowSum,
    stride_qr,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_mb,
    stride_mg,
    stride_mh,
    stride_mq,
    stride_ms,
    stride_or,
    stride_oh,
    stride_os,
    stride_od,
    stride_lr,
    stride_lh,
    stride_ls,
    kv_len,
    split_len,
    scale,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_PER_ROW: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (input, kv head) x query-row block x key range: online softmax over its K/V tiles.

    With ``SPLIT`` the normalised partial output (float32) goes to a workspace ``(B*Hkv, splits,
    rows, Dv)`` and the running max and sum (not their lse: see :func:`_combine_splits_kernel`)
    to ``(B*Hkv, splits, rows)`` ones; otherwise the output goes straight to ``Out`` (query dtype)
    and ``Lse``.
    """
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    batch_index, kv_head, offs_m, row_ok, g, hyp, head, qi = _row_coordinates(
        pid_bh, pid_m, KV_HEADS, GROUP, HEAD_GROUP, Q_LEN, BLOCK_M
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < VALUE_DIM

    q_ptrs = Q + hyp[:, None] * stride_qr + head[:, None] * stride_qh + qi[:, None] * stride_qs
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + batch_index * stride_kb + kv_head * stride_kh + offs_d[:, None] * stride_kd  # [BLOCK_D, 1]
    v_base = V + batch_index * stride_vb + kv_head * stride_vh + offs_dv[None, :] * stride_vd  # [1, BLOCK_DV]
    if HAS_MASK:
        if MASK_PER_ROW:
            mask_rows = Mask + batch_index * stride_mb + g * stride_mg + head * stride_mh + qi * stride_mq
        else:  # one mask row per input, broadcast over the program's rows: load it once per tile
            mask_base = Mask + batch_index * stride_mb

    start = pid_s * split_len
    end = tl.minimum(start + split_len, kv_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < end
        k = tl.load(k_base + cols[None, :] * stride_ks, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        s = _dot(q, k, UPCAST_DOT) * scale
        keep = col_ok[None, :]
        if HAS_MASK:
            if MASK_PER_ROW:
                mv = tl.load(
                    mask_rows[:, None] + cols[None, :] * stride_ms, mask=row_ok[:, None] & col_ok[None, :], other=0
                )
            else:
                mv = tl.load(mask_base + cols * stride_ms, mask=col_ok, other=0)[None, :]
            if MASK_IS_BOOL:
                keep = keep & (mv != 0)
            else:
                s = s + mv.to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, no NaN
        alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)
        p = tl.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT)
        m_i = m_new

    empty = l_i == 0.0  # a finite max contributes exp(0) = 1, so l_i == 0 only when nothing was attended
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    if SPLIT:
        rows_base = (pid_bh * tl.num_programs(2) + pid_s).to(tl.int64) * (GROUP * HEAD_GROUP * Q_LEN)
        o_ptrs = Out + (rows_base + offs_m)[:, None] * VALUE_DIM + offs_dv[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Lse + rows_base + offs_m, m_i, mask=row_ok)
        tl.store(RowSum + rows_base + offs_m, l_i, mask=row_ok)
    else:
        o_ptrs = Out + hyp[:, None] * stride_or + head[:, None] * stride_oh + qi[:, None] * stride_os
        o_ptrs = o_ptrs + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Lse + hyp * stride_lr + head * stride_lh + qi * stride_ls, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    PartOut,
    PartMax,
    PartSum,
    Out,
    Lse,
    num_splits,
    stride_or,
    stride_oh,
    stride_os,
    stride_od,
    stride_lr,
    stride_lh,
    stride_ls,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Merge the key-range splits of one (input, kv head) row block; empty splits (sum 0) add nothing.

    Weights come from each split's (max, sum), not from its lse = max + log(sum): with scores near
    ``finfo.min`` (Transformers' mask value) log(sum) vanishes in rounding and equal lse would
    weigh a 16-key split like a 2-key one, where one softmax over all keys counts every key.
    """
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    _, _, offs_m, row_ok, _, hyp, head, qi = _row_coordinates(
        pid_bh, pid_m, KV_HEADS, GROUP, HEAD_GROUP, Q_LEN, BLOCK_M
    )
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < VALUE_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for split in range(0, num_splits):
        rows_base = (pid_bh * num_splits + split).to(tl.int64) * (GROUP * HEAD_GROUP * Q_LEN)
        max_s = tl.load(PartMax + rows_base + offs_m, mask=row_ok, other=float("-inf"))
        sum_s = tl.load(PartSum + rows_base + offs_m, mask=row_ok, other=0.0)
        m_new = tl.maximum(m_i, max_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)
        weight = sum_s * tl.exp2((max_s - m_safe) * 1.4426950408889634)
        part = tl.load(
            PartOut + (rows_base + offs_m)[:, None] * VALUE_DIM + offs_dv[None, :],
            mask=row_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + weight[:, None] * part
        l_i = l_i * alpha + weight
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_ptrs = Out + hyp[:, None] * stride_or + head[:, None] * stride_oh + qi[:, None] * stride_os
    tl.store(o_ptrs + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + hyp * stride_lr + head * stride_lh + qi * stride_ls, lse, mask=row_ok)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def not_supported_reasons(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None
) -> list[str]:
    """Why this kernel cannot run the call (empty: it can). Shapes only, no device sync."""
    tensors = {"query": query, "key": key, "value": value}
    reasons = [f"{name} is {t.dim()}-D, not 4-D" for name, t in tensors.items() if t.dim() != 4]
    if reasons:
        return reasons
    reasons += [f"{name} is {t.dtype}, not fp32/fp16/bf16" for name, t in tensors.items() if t.dtype not in _DTYPES]
    if len({query.dtype, key.dtype, value.dtype}) > 1:
        reasons.append("query, key and value dtypes differ")
    if len({query.device, key.device, value.device}) > 1:
        reasons.append("query, key and value are on different devices")
    if query.device.type != "cuda" and not (query.device.type == "cpu" and _interpreting()):
        reasons.append(f"{query.device.type} tensors need CUDA (or TRITON_INTERPRET=1 on CPU)")
    rows, heads, q_len, dim = query.shape
    batch, kv_heads, kv_len, key_dim = key.shape
    if batch == 0 or rows % batch or heads % max(kv_heads, 1):
        reasons.append(f"query rows/heads {rows}/{heads} are not multiples of key rows/heads {batch}/{kv_heads}")
    if value.shape[:3] != key.shape[:3] or key_dim != dim:
        reasons.append(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit query {tuple(query.shape)}")
    if min(query.numel(), key.numel(), value.numel()) == 0:
        reasons.append("empty tensor")
    if dim > MAX_HEAD_DIM or value.shape[-1] > MAX_HEAD_DIM:
        reasons.append(f"head dim {dim}/{value.shape[-1]} > {MAX_HEAD_DIM}")
    if attn_mask is not None:
        if attn_mask.dim() != 4:
            reasons.append(f"attn_mask is {attn_mask.dim()}-D, not 4-D")
        else:
            m_rows, m_heads, m_q, m_len = attn_mask.shape
            if m_rows not in (1, batch, rows) or m_heads not in (1, heads) or m_q not in (1, q_len) or m_len != kv_len:
                reasons.append(f"attn_mask shape {tuple(attn_mask.shape)} is not (1|B|B*G, 1|H, 1|q, S)")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _DTYPES:
            reasons.append(f"attn_mask dtype {attn_mask.dtype} is neither bool nor fp32/fp16/bf16")
        if attn_mask.device != query.device:
            reasons.append("attn_mask is on another device")
    return reasons


def _tile_config(dtype: torch.dtype, n_rows: int, block_d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the largest row block that fits in registers without spilling.

    From ptxas register counts of this kernel for sm_90 (fp16/bf16 use tensor cores, fp32 uses
    FMA for the exact ``ieee`` dot and needs smaller tiles); not yet timed on a GPU.
    """
    rows = max(16, triton.next_power_of_2(n_rows))
    if dtype == torch.float32:
        if block_d <= 64:
            block_m = min(rows, 64)
            return block_m, 64 if block_m <= 32 else 32, 4 if block_m == 16 else 8
        return 16, 64 if block_d <= 128 else 32, 4 if block_d <= 128 else 8
    block_m = min(rows, 64, 8192 // block_d)
    return block_m, 64 if block_d <= 128 else 32, 4 if block_m * block_d <= 2048 else 8


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(device: torch.device, programs: int, key_blocks: int) -> int:
    """Split the keys only when (input, kv head, row block) programs alone leave SMs idle."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), key_blocks // MIN_BLOCKS_PER_SPLIT))


def _mask_strides(mask: torch.Tensor, batch: int, group: int, rows: int) -> tuple[int, int, int, int, int]:
    """Strides (input, hypothesis-in-group, head, query, key) of a ``(1|B|B*G, 1|H, 1|q, S)`` mask."""
    m_rows, m_heads, m_q, _ = mask.shape
    s_rows, s_heads, s_q, s_keys = mask.stride()
    if m_rows == rows and group > 1:  # one row per hypothesis
        by_input, by_hyp = group * s_rows, s_rows
    elif m_rows == batch and batch > 1:  # one row per input, shared by its hypotheses
        by_input, by_hyp = s_rows, 0
    else:
        by_input, by_hyp = 0, 0
    return by_input, by_hyp, s_heads if m_heads > 1 else 0, s_q if m_q > 1 else 0, s_keys


@dataclass
class Launch:
    """One kernel launch: what :func:`shared_kv_attention` runs, and what a compile check compiles."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constants: dict[str, Any]
    num_warps: int


def plan(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """Allocate ``out``/``lse`` (and the split workspace) and list the launches that fill them.

    Works on ``meta`` tensors too, so the compile check sees exactly the arguments a real call passes.
    """
    rows, heads, q_len, dim = query.shape
    batch, kv_heads, kv_len, _ = key.shape
    value_dim = value.shape[-1]
    group, head_group = rows // batch, heads // kv_heads
    n_rows = group * head_group * q_len
    scale = dim**-0.5 if scale is None else float(scale)
    block_d = max(16, triton.next_power_of_2(dim))
    block_dv = max(16, triton.next_power_of_2(value_dim))
    block_m, default_block_n, num_warps = _tile_config(query.dtype, n_rows, max(block_d, block_dv))
    block_n = block_n or default_block_n
    row_blocks = triton.cdiv(n_rows, block_m)
    key_blocks = triton.cdiv(kv_len, block_n)
    if num_splits is None:
        num_splits = _default_splits(query.device, batch * kv_heads * row_blocks, key_blocks)
    split_len = triton.cdiv(key_blocks, max(1, min(num_splits, key_blocks))) * block_n
    num_splits = triton.cdiv(kv_len, split_len)  # no empty trailing split

    out = torch.empty((rows, heads, q_len, value_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((rows, heads, q_len), dtype=torch.float32, device=query.device)
    if attn_mask is None:
        mask, mask_strides, mask_per_row = query, (0, 0, 0, 0, 0), False
    else:
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        mask_strides = _mask_strides(attn_mask, batch, group, rows)
        mask_per_row = any(mask_strides[1:4])
    split = num_splits > 1
    if split:
        target = torch.empty((batch * kv_heads, num_splits, n_rows, value_dim), dtype=torch.float32, device=out.device)
        target_max = torch.empty((batch * kv_heads, num_splits, n_rows), dtype=torch.float32, device=out.device)
        target_sum = torch.empty_like(target_max)
    else:
        target, target_max, target_sum = out, lse, lse
    shape_constants = {"KV_HEADS": kv_heads, "GROUP": group, "HEAD_GROUP": head_group, "Q_LEN": q_len}
    attend = Launch(
        _shared_kv_attention_kernel,
        (batch * kv_heads, row_blocks, num_splits),
        (
            *(query, key, value, mask, target, target_max, target_sum),
            *query.stride(),
            *key.stride(),
            *value.stride(),
            *mask_strides,
            *out.stride(),
            *lse.stride(),
            *(kv_len, split_len, scale),
        ),
        shape_constants
        | {
            "HEAD_DIM": dim,
            "VALUE_DIM": value_dim,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_D": block_d,
            "BLOCK_DV": block_dv,
            "HAS_MASK": attn_mask is not None,
            "MASK_IS_BOOL": attn_mask is not None and attn_mask.dtype == torch.bool,
            "MASK_PER_ROW": mask_per_row,
            "SPLIT": split,
            "UPCAST_DOT": query.dtype == torch.bfloat16 and _interpreting(),
        },
        num_warps,
    )
    if not split:
        return out, lse, [attend]
    combine = Launch(
        _combine_splits_kernel,
        (batch * kv_heads, row_blocks),
        (target, target_max, target_sum, out, lse, num_splits, *out.stride(), *lse.stride()),
        shape_constants | {"VALUE_DIM": value_dim, "BLOCK_M": block_m, "BLOCK_DV": block_dv},
        4,
    )
    return out, lse, [attend, combine]


def shared_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`fastgen.ops.attention.shared_kv_attention_reference`.

    The caller checks :func:`not_supported_reasons` first. ``block_n`` (keys per tile) and
    ``num_splits`` (key-range splits) exist for tests; by default the keys are split only when
    the (input, kv head) programs cannot fill the GPU.
    """
    out, lse, launches = plan(query, key, value, attn_mask, scale, block_n=block_n, num_splits=num_splits)
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.constants, num_warps=launch.num_warps)
    return out, lse
