"""The multi-tensor DualOptim+ AdamW kernel's source (`multi_tensor.py` says what it does and when it runs).

A module of its own because it imports Triton, which doplus does not require (the CPU path needs no Triton),
and because Triton's interpreter (the tests' way to run the kernel on CPU tensors) patches `tl` among the
kernel's globals. Not decorated here: `multi_tensor._kernel` wraps it with `triton.jit` or the interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def _round_to_bfloat16(x):
    """float32 → the nearest bfloat16 value, ties to even, still float32 (`kernels.round_to_bfloat16`): the
    cast that stores it is then exact, whatever rounding the cast would do (Triton's interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _record(ratio, mask, largest, big, nans, BIG: tl.constexpr):
    """Add one block's |Δθ|/η to a tile's diagnostics: the largest finite value, the count above BIG, the NaNs
    (counted apart: Triton's max would drop them, torch's amax keeps them)."""
    nans += (mask & (ratio != ratio)).to(tl.int32)
    ratio = tl.where(mask & (ratio == ratio), ratio, 0.0)
    return tl.maximum(largest, ratio), big + (ratio > BIG).to(tl.int32), nans


@triton.jit
def _tile(p_ptr, g_ptr, mb_ptr, vb_ptr, md_ptr, vd_ptr, c_ptr, hp, first, limit,
          COMPENSATED: tl.constexpr, BIG: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Elements [first, min(first + TILE, limit)) of one tensor; returns the tile's diagnostics (largest
    finite |Δθ|/η, elements above BIG, NaN elements)."""
    lr = tl.load(hp + 0)
    decay = tl.load(hp + 1)
    b1 = tl.load(hp + 2)
    c1 = tl.load(hp + 3)
    b2 = tl.load(hp + 4)
    c2 = tl.load(hp + 5)
    bb1 = tl.load(hp + 6)
    cb1 = tl.load(hp + 7)
    bb2 = tl.load(hp + 8)
    cb2 = tl.load(hp + 9)
    eps = tl.load(hp + 10)
    ibb1 = tl.load(hp + 11)
    ibb2 = tl.load(hp + 12)
    ib1 = tl.load(hp + 13)
    ib2 = tl.load(hp + 14)
    floor = tl.load(hp + 15)
    max_step = tl.load(hp + 16)
    max_ratio = tl.load(hp + 17)
    wd = tl.load(hp + 18)
    largest = tl.zeros((BLOCK,), tl.float32)
    big = tl.zeros((BLOCK,), tl.int32)
    nans = tl.zeros((BLOCK,), tl.int32)
    for offset in tl.static_range(0, TILE, BLOCK):
        idx = first + offset + tl.arange(0, BLOCK)
        mask = idx < limit
        theta = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if COMPENSATED:
            theta = theta + tl.load(c_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        mb = tl.load(mb_ptr + idx, mask=mask, other=0.0)
        vb = tl.load(vb_ptr + idx, mask=mask, other=0.0)
        md = tl.load(md_ptr + idx, mask=mask, other=0.0)
        vd = tl.load(vd_ptr + idx, mask=mask, other=0.0)
        # kernels._adamw_plus_math, line for line
        theta_old = theta
        theta = theta * decay
        mb_hat = mb * ibb1
        vb_hat = vb * ibb2
        md = b1 * md + c1 * (g - mb_hat)
        vd = b2 * vd + c2 * (g * g - vb_hat)
        m = mb_hat + md * ib1
        vd_hat = vd * ib2
        v = vb_hat + vd_hat
        denominator = tl.sqrt(tl.maximum(tl.abs(v), floor * (vb_hat + tl.abs(vd_hat)),
                                         propagate_nan=tl.PropagateNan.ALL)) + eps
        step = lr * m / denominator
        step = tl.minimum(tl.maximum(step, -max_step, propagate_nan=tl.PropagateNan.ALL), max_step,
                          propagate_nan=tl.PropagateNan.ALL)
        theta = theta - step
        per_lr = m / denominator
        per_lr = tl.minimum(tl.maximum(per_lr, -max_ratio, propagate_nan=tl.PropagateNan.ALL), max_ratio,
                            propagate_nan=tl.PropagateNan.ALL)
        ratio = tl.abs(wd * theta_old + per_lr)
        mb = bb1 * mb + cb1 * g
        vb = bb2 * vb + cb2 * (g * g)
        if COMPENSATED:  # kernels.write_master: θ_bf16 ← bf16(θ'), c ← bf16(θ' − θ_bf16)
            rounded = _round_to_bfloat16(theta)
            tl.store(p_ptr + idx, rounded.to(p_ptr.dtype.element_ty), mask=mask)
            tl.store(c_ptr + idx, _round_to_bfloat16(theta - rounded).to(tl.bfloat16), mask=mask)
        elif p_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(p_ptr + idx, _round_to_bfloat16(theta).to(tl.bfloat16), mask=mask)
        else:
            tl.store(p_ptr + idx, theta.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(mb_ptr + idx, mb, mask=mask)
        tl.store(vb_ptr + idx, vb, mask=mask)
        tl.store(md_ptr + idx, md, mask=mask)
        tl.store(vd_ptr + idx, vd, mask=mask)
        largest, big, nans = _record(ratio, mask, largest, big, nans, BIG)
    return tl.max(largest, 0), tl.sum(big, 0), tl.sum(nans, 0)


def adamw_plus_multi_tensor_kernel(
    table, tile_tensor, tile_start, hp, out_max, out_big, out_nan, n_tensors,
    p_base, g_base, mb_base, vb_base, md_base, vd_base, c_base,
    WEIGHT_VEC: tl.constexpr, GRAD_VEC: tl.constexpr, COMPENSATED: tl.constexpr, BIG: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr,
):
    # Each tensor is addressed as base + offset, the base a kernel argument (16-byte aligned, which Triton
    # knows from the argument) and the offset in elements from the table, declared a multiple of 16 bytes:
    # so the compiler can prove every access aligned and use vector loads (an address read from memory and
    # cast to a pointer carries no alignment, and on an H200 compiled to scalar loads only).
    pid = tl.program_id(0)
    t = tl.load(tile_tensor + pid).to(tl.int64)
    first = tl.multiple_of(tl.load(tile_start + pid), TILE)
    numel = tl.load(table + 7 * n_tensors + t)
    hp = hp + tl.load(table + 8 * n_tensors + t) * 19  # this tensor's row of scalars
    p_ptr = p_base + tl.multiple_of(tl.load(table + t), WEIGHT_VEC)
    g_ptr = g_base + tl.multiple_of(tl.load(table + n_tensors + t), GRAD_VEC)
    mb_ptr = mb_base + tl.multiple_of(tl.load(table + 2 * n_tensors + t), 4)
    vb_ptr = vb_base + tl.multiple_of(tl.load(table + 3 * n_tensors + t), 4)
    md_ptr = md_base + tl.multiple_of(tl.load(table + 4 * n_tensors + t), 4)
    vd_ptr = vd_base + tl.multiple_of(tl.load(table + 5 * n_tensors + t), 4)
    c_ptr = c_base + tl.multiple_of(tl.load(table + 6 * n_tensors + t), 8)
    # A whole tile needs no bound but its own end, which the compiler knows to be a multiple of TILE, so the
    # mask is constant over 16-byte groups and loads vectorize; only a tensor's last tile is masked at numel.
    if first + TILE <= numel:
        largest, big, nans = _tile(p_ptr, g_ptr, mb_ptr, vb_ptr, md_ptr, vd_ptr, c_ptr, hp, first, first + TILE,
                                   COMPENSATED, BIG, TILE, BLOCK)
    else:
        largest, big, nans = _tile(p_ptr, g_ptr, mb_ptr, vb_ptr, md_ptr, vd_ptr, c_ptr, hp, first, numel,
                                   COMPENSATED, BIG, TILE, BLOCK)
    tl.store(out_max + pid, largest)
    tl.store(out_big + pid, big)
    tl.store(out_nan + pid, nans)


@triton.jit
def _adam_stats_tile(t_ptr, m_ptr, v_ptr, hp, first, limit, BIG: tl.constexpr, TILE: tl.constexpr,
                     BLOCK: tl.constexpr):
    """`diagnostics._adam_ratio_stats` on elements [first, min(first + TILE, limit)) of one tensor."""
    inv_bc1 = tl.load(hp + 0)
    inv_bc2 = tl.load(hp + 1)
    eps = tl.load(hp + 2)
    lr = tl.load(hp + 3)
    wd = tl.load(hp + 4)
    inv_decay = tl.load(hp + 5)
    largest = tl.zeros((BLOCK,), tl.float32)
    big = tl.zeros((BLOCK,), tl.int32)
    nans = tl.zeros((BLOCK,), tl.int32)
    for offset in tl.static_range(0, TILE, BLOCK):
        idx = first + offset + tl.arange(0, BLOCK)
        mask = idx < limit
        theta = tl.load(t_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        u = (m * inv_bc1) / (tl.sqrt(v * inv_bc2) + eps)
        theta_old = (theta + lr * u) * inv_decay
        ratio = tl.abs(u + wd * theta_old)
        largest, big, nans = _record(ratio, mask, largest, big, nans, BIG)
    return tl.max(largest, 0), tl.sum(big, 0), tl.sum(nans, 0)


def adam_stats_multi_tensor_kernel(
    table, tile_tensor, tile_start, hp, out_max, out_big, out_nan, n_tensors, t_base, m_base, v_base,
    WEIGHT_VEC: tl.constexpr, BIG: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
):
    """The step diagnostics of an AdamW step over many tensors, from θ and the moments just written
    (`diagnostics.py`); the table as the DualOptim+ kernel's: offsets of θ, m, v, then numel and row."""
    pid = tl.program_id(0)
    t = tl.load(tile_tensor + pid).to(tl.int64)
    first = tl.multiple_of(tl.load(tile_start + pid), TILE)
    numel = tl.load(table + 3 * n_tensors + t)
    hp = hp + tl.load(table + 4 * n_tensors + t) * 6
    t_ptr = t_base + tl.multiple_of(tl.load(table + t), WEIGHT_VEC)
    m_ptr = m_base + tl.multiple_of(tl.load(table + n_tensors + t), 4)
    v_ptr = v_base + tl.multiple_of(tl.load(table + 2 * n_tensors + t), 4)
    if first + TILE <= numel:
        largest, big, nans = _adam_stats_tile(t_ptr, m_ptr, v_ptr, hp, first, first + TILE, BIG, TILE, BLOCK)
    else:
        largest, big, nans = _adam_stats_tile(t_ptr, m_ptr, v_ptr, hp, first, numel, BIG, TILE, BLOCK)
    tl.store(out_max + pid, largest)
    tl.store(out_big + pid, big)
    tl.store(out_nan + pid, nans)
