"""8-bit blockwise optimizer states with bitsandbytes' dynamic quantisation maps.

A state tensor of n elements is stored as n uint8 codes plus one fp32 absmax per block of 256 elements
(bitsandbytes' layout, the last block may be short). Value = code_map[code] · absmax[block].

* `quantize` / `dequantize` call bitsandbytes' own functions: they are the reference.
* The fused path (`kernels.adamw_plus_fused_8bit`) dequantizes, updates and re-quantizes in one compiled
  kernel. To give bit-identical codes it needs bitsandbytes' exact rounding rule, which differs between
  versions and devices (nearest by binary search on CUDA, a 65536-entry lookup table on CPU in 0.50).
  Any such rule is a monotone step function of the normalised value x·(1/absmax), so `decision_thresholds`
  reads its 255 steps off bitsandbytes itself by bisection over float32 bit patterns; the fused kernel
  then counts thresholds ≤ x. Counting is done with a 65536-entry table indexed by the top 16 bits of the
  float32 value (sign, exponent, 7 mantissa bits) plus `fixup_steps` comparisons, each of which jumps over a
  run of equal thresholds: `SearchTables`. `tests/test_quant.py` checks it equals bitsandbytes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BLOCKSIZE = 256
MIN_8BIT_SIZE = 4096  # tensors smaller than this keep fp32 states (as bitsandbytes' optimizers do)


def _bnb_functional():
    import bitsandbytes.functional as bnbf

    return bnbf


@functools.cache
def code_map(signed: bool, device: str) -> Tensor:
    """bitsandbytes' dynamic map: signed for first moments and delta second moments, unsigned for v_B."""
    return _bnb_functional().create_dynamic_map(signed=signed).to(device)


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCKSIZE)


def quantize(x: Tensor, signed: bool, out_codes: Tensor, out_absmax: Tensor) -> None:
    """Reference quantisation of a float32 tensor into `out_codes` (uint8) and `out_absmax` (fp32)."""
    code = code_map(signed, str(x.device))
    codes, qstate = _bnb_functional().quantize_blockwise(
        x.float().contiguous().view(-1), code=code, blocksize=BLOCKSIZE
    )
    out_codes.view(-1).copy_(codes)
    out_absmax.copy_(qstate.absmax)


def dequantize(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """Reference dequantisation to a new float32 tensor shaped like `codes`."""
    code = code_map(signed, str(codes.device))
    out = _bnb_functional().dequantize_blockwise(
        codes.contiguous().view(-1), absmax=absmax, code=code, blocksize=BLOCKSIZE
    )
    return out.view(codes.shape)


def embedding_weights(model: torch.nn.Module) -> list[Tensor]:
    """The weights of the model's vocabulary tables: every `torch.nn.Embedding`, and the output layer
    (`get_output_embeddings`) whether tied or not. An untied output layer's rows see gradients as unequal as the
    input table's (the target tokens' rows against the rest): on an H100, Alternate with 8-bit states and bf16
    weights took steps of 2,610 lr with only the input table kept 32-bit."""
    weights = [module.weight for module in model.modules() if isinstance(module, torch.nn.Embedding)]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(output, "weight", None)
    if isinstance(weight, Tensor) and all(weight is not w for w in weights):
        weights.append(weight)
    return weights


def adamw8bit(params, full_precision: Iterable[Tensor] = (), **kwargs):
    """bitsandbytes' AdamW8bit whose states for the tensors in `full_precision` stay 32-bit.

    bitsandbytes advises 32-bit states for embedding tables (its `StableEmbedding`, or `optim_bits` 32 for them).
    A row absent from a batch has a zero gradient; where its second moment was re-quantised to 0 while its first
    moment was not (a block shared with rows of gradients thousands of times larger), its step is m / eps. On an
    H100 (bitsandbytes 0.50.2) a 600 x 32 table with such rows took steps of up to 19,954 lr where torch's AdamW
    takes at most ~1.2 lr; on the CPU the same steps stayed under 1.2 lr. The other
    tensors' states stay 8-bit, so the memory saved is the same but for the tables."""
    import bitsandbytes as bnb

    kept = {id(p) for p in full_precision}

    class AdamW8bit(bnb.optim.AdamW8bit):
        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if id(group["params"][pindex]) in kept:
                config["optim_bits"] = 32
            return config

    return AdamW8bit(params, min_8bit_size=MIN_8BIT_SIZE, **kwargs)


def _float_bits(x: Tensor) -> Tensor:
    """Monotone map float32 → int64 (order-preserving over all finite floats)."""
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _bits_float(i: Tensor) -> Tensor:
    raw = torch.where(i < 0, (-i) | 0x80000000, i)
    return raw.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)


def _bnb_codes_of_normalised(values: Tensor, signed: bool) -> Tensor:
    """bitsandbytes' code for each normalised value in [-1, 1], each quantised in its own block with absmax 1."""
    n = values.numel()
    blocks = torch.zeros(n, BLOCKSIZE, dtype=torch.float32, device=values.device)
    blocks[:, 0] = values
    blocks[:, 1] = 1.0  # absmax of the block is exactly 1, so the normalised value is the value itself
    codes, _ = _bnb_functional().quantize_blockwise(
        blocks.view(-1), code=code_map(signed, str(values.device)), blocksize=BLOCKSIZE
    )
    return codes.view(n, BLOCKSIZE)[:, 0].to(torch.int64)


@functools.cache
def decision_thresholds(signed: bool, device: str) -> Tensor:
    """The 255 smallest normalised values at which bitsandbytes' code steps up: code(x) = #{thr ≤ x}.

    Found by bisection on float32 bit patterns in [-1, 1] against bitsandbytes' own quantiser.
    """
    dev = torch.device(device)
    targets = torch.arange(1, 256, device=dev)
    lo = _float_bits(torch.full((255,), -1.0, device=dev))  # code(lo) < target always holds at -1
    hi = _float_bits(torch.full((255,), 1.0, device=dev))
    base = _bnb_codes_of_normalised(_bits_float(lo), signed)
    top = _bnb_codes_of_normalised(_bits_float(hi), signed)
    # code(-1) is the lowest step: thresholds at or below -1 are represented by -1 itself
    reached_at_lo = base >= targets
    unreachable = top < targets
    while True:
        active = (hi - lo) > 1
        if not bool(active.any()):
            break
        mid = (lo + hi) // 2
        at_mid = _bnb_codes_of_normalised(_bits_float(mid), signed)
        go_hi = at_mid >= targets
        hi = torch.where(active & go_hi, mid, hi)
        lo = torch.where(active & ~go_hi, mid, lo)
    thresholds = _bits_float(hi)
    thresholds = torch.where(reached_at_lo, torch.full_like(thresholds, -1.0), thresholds)
    thresholds = torch.where(unreachable, torch.full_like(thresholds, float("inf")), thresholds)
    return thresholds.contiguous()


@dataclass(frozen=True)
class SearchTables:
    """Tables that turn a normalised float32 x into bitsandbytes' code #{thresholds ≤ x} in a few loads.

    bucket_start[b]: the code of the lowest value whose top 16 bits are b;
    thresholds[i]:   the i-th threshold (padded with +inf at 255);
    skip[i]:         #{thresholds ≤ thresholds[i]}, i.e. the code past a run of equal thresholds;
    fixup_steps:     how many distinct thresholds one bucket can hold (1 for bitsandbytes' maps).
    bucket_threshold, bucket_codes: when fixup_steps == 1, the one threshold inside bucket b (+inf if none)
                     and the codes below / at-or-above it packed as low | high << 8, so a value needs two
                     table loads at the same index instead of three dependent ones.
    """

    bucket_start: Tensor
    thresholds: Tensor
    skip: Tensor
    fixup_steps: int
    bucket_threshold: Tensor
    bucket_codes: Tensor


@functools.cache
def search_tables(signed: bool, device: str) -> SearchTables:
    thresholds = decision_thresholds(signed, device).cpu()
    raw = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = raw.to(torch.int32).view(torch.float32)  # value with the remaining 16 bits all zero
    high = (raw | 0xFFFF).to(torch.int32).view(torch.float32)  # ... all one
    lowest, highest = torch.minimum(low, high), torch.maximum(low, high)
    valid = torch.isfinite(lowest) & torch.isfinite(highest) & (highest.abs() <= 1) & (lowest.abs() <= 1)
    bucket_start = torch.searchsorted(thresholds, lowest.nan_to_num(0.0).clamp(-1, 1), right=True)
    distinct = torch.unique(thresholds)
    inside = torch.searchsorted(distinct, highest.clamp(-1, 1), right=True) - torch.searchsorted(
        distinct, lowest.clamp(-1, 1), right=True
    )
    fixup_steps = int(inside[valid].max().item()) if bool(valid.any()) else 0
    padded = torch.cat([thresholds, torch.tensor([float("inf")])])
    skip = torch.searchsorted(thresholds, padded, right=True).clamp(max=255)
    inner_threshold = padded[bucket_start]  # the first threshold above the bucket's lowest value
    inner_threshold = torch.where(inner_threshold <= highest.clamp(-1, 1), inner_threshold, float("inf"))
    codes_above = skip[bucket_start]
    dev = torch.device(device)
    return SearchTables(
        bucket_start=bucket_start.to(torch.int32).to(dev),
        thresholds=padded.to(dev),
        skip=skip.to(torch.int32).to(dev),
        fixup_steps=fixup_steps,
        bucket_threshold=inner_threshold.to(dev),
        bucket_codes=(bucket_start | (codes_above << 8)).to(torch.int32).to(dev),
    )


def _walk_tensors(value: Any):
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk_tensors(item)


def state_bytes(state: dict) -> int:
    """Bytes held by all tensors of one parameter's optimizer state (nested dicts included)."""
    return sum(t.numel() * t.element_size() for t in _walk_tensors(state))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of all tensors in the optimizer's state (numel x element size; 8-bit states count their codes and
    block scales), nested per-objective states included; a tensor shared between parameters counts once."""
    unique = {id(t): t for state in optimizer.state.values() for t in _walk_tensors(state)}
    return sum(t.numel() * t.element_size() for t in unique.values())
