"""Quantized linears as ops the backend lowers per step width.

Four ops, for models to call (``examples/llama/quantize.py`` does):

- ``offgraph_kv::int8_linear(x, qdata, scale)``: ``qdata [N, K]`` int8, one
  scale per output row (``scale [N]``, the activations' dtype);
- ``offgraph_kv::int4_linear(x, packed, scale, zero)``: values in [-8, 7] in
  groups of ``G`` inputs, stored two per byte: ``packed [N, K/G, G/2]`` uint8
  holds ``q + 8`` of input ``j`` of a group in the low nibble and of input
  ``j + G/2`` in the high one (llama.cpp's Q4_0 order: both halves of a byte
  meet contiguous inputs, so no interleaving is needed); ``scale [N, K/G]``;
  ``zero`` (int8 ``[N, K/G]``, or None for symmetric) is subtracted first:
  ``w = (q - zero) * scale``, torchao's dequantisation;
- ``offgraph_kv::int4_da8_linear(x, packed, scale, rowsum)``: int8 dynamic
  activations (per token, asymmetric) x symmetric int4 weights in groups,
  torchao's ``Int8DynamicActivationIntxWeightConfig`` ("8da4w"), the weights in
  tiles of 16 outputs x 8 inputs (``pack_int4_tiles``) for an integer dot
  kernel; on CPU every width runs ``native/dynamic_linear.cpp``, elsewhere
  torchao's own form (activations quantized and dequantized, then ``mm``);
- ``offgraph_kv::int8_da8_linear(x, packed, scale, wsum)``: the same with int8
  weights, one scale per output row ("8da8w"; ``pack_int8_tiles``).

The backend (``lower_quantized_linears``) replaces every call before
AOTInductor compiles: on CPU, unless ``OFFGRAPH_KV_CPU_GEMV=mm``, with a branch
on the step's rows (``torch.cond``, as ``decode_gemv`` does for float
linears): one row -> our kernel, ``native/decode_linear.cpp`` (the default
mode), or with ``OFFGRAPH_KV_CPU_GEMV=reduce`` one fused
inductor reduction over the stored integers (either way the weight bytes read
once, dequantised in registers, fp32 accumulation; where the kernel does not
take the dtypes, the reduction; on bf16 rows the kernel takes int4 groups of 32
through bf16 dot products and int8 rows against the activations as int16
blocks, see its comments),
wider -> on CPU with bf16 activations, on a machine with the AVX-512 bf16 dot
product, the same kernels' GEMM (``native/wide_rows.h``: the weights
dequantized to bf16 a block of rows at a time, torchao's rounding); otherwise
what a GEMM needs (int8: the weight dequantised, then ``mm``, torchao's own
form; int4: each nibble half dequantised, then two ``mm``; on CPU a
cache-sized block of weight rows at a time, ``block_rows``; the ``mm`` in fp32
where the CPU has no native GEMM for the activations' dtype, ``gemm.py``).
Elsewhere the wider form serves every width.

Why the reductions are shaped as they are (inductor's C++ backend; kernels
measured by ``benchmarks/cpu/quant_gemv.py``): the inner dim of each reduction
is the contiguous one, so the weight and activation loads vectorise; ``x``
is converted to an fp32 buffer of its own first (``_fp32_rows``); int4 nibbles
are split after a widening to int32 and the unsigned offset 8 (plus the zero
point) is taken out of the inner loop as ``scale * offset * sum(x)`` per group
(1536 x 576: 65.7 us with uint8 ops and the offset per weight, 53.7 us so;
int16 ops fell back to scalar code, 472 us).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from torch import fx

import offgraph_kv.backend.cpu_kernels  # noqa: F401  (registers the offgraph_kv::*_linear_rows kernels)
from offgraph_kv.backend.gemm import gemm
from offgraph_kv.backend.width_branch import by_width

# --------------------------------------------------------------------------- #
# Packing
# --------------------------------------------------------------------------- #


def pack_int4(qdata: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` int8 in [-8, 7] -> ``[N, K/G, G/2]`` uint8, two values a byte (the layout above)."""
    n, k = qdata.shape
    if group_size % 2 or k % group_size:
        raise ValueError(f"int4 packing needs an even group size dividing {k}, got {group_size}")
    if qdata.numel() and (int(qdata.min()) < -8 or int(qdata.max()) > 7):
        raise ValueError("int4 packing: values outside [-8, 7]")
    u = (qdata.to(torch.int16) + 8).to(torch.uint8).view(n, k // group_size, 2, group_size // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[N, K/G, G/2]`` uint8 -> ``[N, K]`` int8."""
    n, groups, half = packed.shape
    p = packed.to(torch.int16)
    q = torch.stack([p & 15, p >> 4], dim=2) - 8  # [N, K/G, 2, G/2]
    return q.reshape(n, groups * 2 * half).to(torch.int8)


TILE_ROWS, TILE_INPUTS, TILE_INPUTS_INT8 = 16, 8, 4  # native/dynamic_linear.cpp's tiles


def pack_int4_tiles(qdata: torch.Tensor, scale: torch.Tensor,
                    group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` int8 in [-8, 7] and ``scale [N, K/G]`` -> the int4_da8 kernel's ``packed [B, K/8, 64]``
    uint8, ``scale [B, K/G, 16]`` and ``rowsum [N]`` fp32 (B = N/16 rounded up; the layout is
    ``native/dynamic_linear.cpp``'s): byte ``4r + j`` of tile ``(b, t)`` holds ``q + 8`` of output
    ``16b + r`` at input ``8t + j`` (low nibble) and ``8t + 4 + j`` (high nibble)."""
    n, k = qdata.shape
    if group_size % TILE_INPUTS or k % group_size:
        raise ValueError(f"int4 tiles need a group size that is a multiple of {TILE_INPUTS} and divides {k}, "
                         f"got {group_size}")
    if tuple(scale.shape) != (n, k // group_size):
        raise ValueError(f"int4 tiles: scale has shape {tuple(scale.shape)}, expected {(n, k // group_size)}")
    if qdata.numel() and (int(qdata.min()) < -8 or int(qdata.max()) > 7):
        raise ValueError("int4 packing: values outside [-8, 7]")
    blocks = -(-n // TILE_ROWS)
    pad = blocks * TILE_ROWS - n
    u = torch.nn.functional.pad(qdata.to(torch.int16) + 8, (0, 0, 0, pad), value=8).to(torch.uint8)
    u = u.view(blocks, TILE_ROWS, k // TILE_INPUTS, 2, 4).permute(0, 2, 1, 3, 4)  # [B, K/8, 16, lo|hi, 4]
    packed = (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(blocks, k // TILE_INPUTS, TILE_ROWS * 4).contiguous()
    tiled_scale = torch.nn.functional.pad(scale, (0, 0, 0, pad)).view(blocks, TILE_ROWS, -1)
    rowsum = (qdata.double() * scale.double().repeat_interleave(group_size, dim=1)).sum(1).float()
    tiled_scale = tiled_scale.transpose(1, 2)
    # Row-major strides even where a dim is 1 (AOTInductor checks a weight's strides exactly).
    return packed, torch.empty(tiled_scale.shape, dtype=scale.dtype).copy_(tiled_scale), rowsum


def unpack_int4_tiles(packed: torch.Tensor, outputs: int) -> torch.Tensor:
    """Inverse of ``pack_int4_tiles``' packing: ``[B, K/8, 64]`` uint8 -> ``[outputs, K]`` int8."""
    blocks, tiles, _ = packed.shape
    p = packed.to(torch.int16).view(blocks, tiles, TILE_ROWS, 4)
    q = torch.stack([p & 15, p >> 4], dim=3) - 8  # [B, K/8, 16, 2, 4]
    return q.permute(0, 2, 1, 3, 4).reshape(blocks * TILE_ROWS, tiles * TILE_INPUTS)[:outputs].to(torch.int8)


def pack_int8_tiles(qdata: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` int8 and one scale per row -> the int8_da8 kernel's ``packed [B, K/4, 64]`` int8 (byte
    ``4r + j`` of tile ``(b, t)``: output ``16b + r``, input ``4t + j``; the last tile padded with zero
    rows), ``scale [N]`` and ``wsum [N]`` int32 (each row's sum of values)."""
    n, k = qdata.shape
    if k % TILE_INPUTS_INT8:
        raise ValueError(f"int8 tiles need inputs in multiples of {TILE_INPUTS_INT8}, got {k}")
    if scale.numel() != n:
        raise ValueError(f"int8 tiles: {scale.numel()} scales for {n} rows")
    blocks = -(-n // TILE_ROWS)
    q = torch.nn.functional.pad(qdata, (0, 0, 0, blocks * TILE_ROWS - n))
    packed = q.view(blocks, TILE_ROWS, k // TILE_INPUTS_INT8, 4).permute(0, 2, 1, 3)
    packed = packed.reshape(blocks, k // TILE_INPUTS_INT8, TILE_ROWS * 4).contiguous()
    return packed, scale.reshape(n).contiguous(), qdata.to(torch.int32).sum(1, dtype=torch.int32)


def unpack_int8_tiles(packed: torch.Tensor, outputs: int) -> torch.Tensor:
    """Inverse of ``pack_int8_tiles``' packing: ``[B, K/4, 64]`` -> ``[outputs, K]`` int8."""
    blocks, tiles, _ = packed.shape
    q = packed.view(blocks, tiles, TILE_ROWS, 4).permute(0, 2, 1, 3)
    return q.reshape(blocks * TILE_ROWS, tiles * TILE_INPUTS_INT8)[:outputs]


def quantize_per_token(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's per-token asymmetric int8 quantization of ``x [R, K]`` (``choose_qparams_affine`` then
    ``quantize_affine``, each op in ``x``'s dtype): ``(xq int8 [R, K], scale [R] x's dtype, zero int32 [R])``."""
    lo = torch.clamp(x.amin(-1), max=0.0)
    hi = torch.clamp(x.amax(-1), min=0.0)
    scale = torch.clamp((hi - lo) / 255.0, min=torch.finfo(x.dtype).smallest_normal)
    zero = torch.clamp(-128 - torch.round(lo / scale), -128, 127)
    xq = torch.clamp(torch.round(x * (1.0 / scale).unsqueeze(-1)) + zero.unsqueeze(-1), -128, 127)
    return xq.to(torch.int8), scale, zero.to(torch.int32)


def untile_scale(scale: torch.Tensor, outputs: int) -> torch.Tensor:
    """Inverse of ``pack_int4_tiles``' scale tiling: ``[B, K/G, 16]`` -> ``[outputs, K/G]``."""
    blocks, groups, _ = scale.shape
    return scale.transpose(1, 2).reshape(blocks * TILE_ROWS, groups)[:outputs]


def _dequantized_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized per token and dequantized in its dtype, as torchao's linear sees it."""
    xq, sx, zero = quantize_per_token(x)
    return (xq.to(torch.int32) - zero.unsqueeze(-1)).to(x.dtype) * sx.unsqueeze(-1)


def int4_da8_integer_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          rowsum: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch: the integer dot per group (exact, in fp64), then
    ``sx * (sum_g scale * dot_g - zero * rowsum)`` in fp32, in ``x``'s dtype."""
    n = rowsum.shape[0]
    xq, sx, zero = quantize_per_token(x)
    q = unpack_int4_tiles(packed, n).double()  # [N, K]
    groups = scale.shape[1]
    g = q.shape[1] // groups
    dots = torch.einsum("rgi,ngi->rng", xq.double().view(-1, groups, g), q.view(n, groups, g)).float()
    y = (dots * untile_scale(scale, n).float()).sum(-1) - zero.float().unsqueeze(-1) * rowsum
    return (sx.float().unsqueeze(-1) * y).to(x.dtype)


def int4_da8_torchao_form(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          rowsum: torch.Tensor) -> torch.Tensor:
    """torchao's own computation of the same linear: activations quantized and dequantized in their
    dtype, the weight dequantized in it, then ``mm`` (``x [R, K]``)."""
    n, groups = rowsum.shape[0], scale.shape[1]
    q = unpack_int4_tiles(packed, n)
    w = (q.view(n, groups, -1).to(x.dtype) * untile_scale(scale, n).to(x.dtype).unsqueeze(-1)).reshape(n, -1)
    return torch.mm(_dequantized_per_token(x), w.t())


def int8_da8_integer_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          wsum: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel computes, in torch: ``sx * scale * (sum (xq + 128) q - (128 + zero) * wsum)``,
    the integers exact (fp64 holds them), in ``x``'s dtype."""
    xq, sx, zero = quantize_per_token(x)
    q = unpack_int8_tiles(packed, wsum.shape[0]).double()
    dots = (xq.double() + 128) @ q.t() - (128 + zero.double()).unsqueeze(-1) * wsum.double()
    return (sx.float().unsqueeze(-1) * (dots.float() * scale.float())).to(x.dtype)


def int8_da8_torchao_form(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          wsum: torch.Tensor) -> torch.Tensor:
    """torchao's computation: activations quantized and dequantized, the weight dequantized, ``mm``."""
    w = unpack_int8_tiles(packed, wsum.shape[0]).to(x.dtype) * scale.to(x.dtype).unsqueeze(-1)
    return torch.mm(_dequantized_per_token(x), w.t())


# --------------------------------------------------------------------------- #
# The forms of each op
# --------------------------------------------------------------------------- #


def _fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 as a buffer of its own. Converted inside the reduction instead, a bf16 ``x`` makes
    inductor tile the loop by 32 (bf16's vector) with half-vector int8 loads: SmolLM2's 49152 x 576
    int8 row took 2.57 ms, against 0.85 ms with fp32 rows (``as_strided`` has inductor realise it)."""
    if x.dtype == torch.float32:
        return x
    xf = x.float().contiguous()  # a strided x keeps its strides through .float(): as_strided needs rows
    return torch.as_strided(xf, xf.shape, (xf.shape[-1], 1))


def int8_one_row(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` -> ``[R, N]``: ``scale[n] * sum_k x[r, k] * q[n, k]`` in fp32, for R == 1 (written for any
    R: ``torch.cond`` traces both branches with the step's symbolic rows, and the weights' extents too)."""
    return ((_fp32_rows(x).unsqueeze(1) * qdata.float()).sum(-1) * scale.float()).to(x.dtype)


# Wider steps dequantize a block of weight rows at a time on CPU: the block is cache-sized and the
# transient is one block, not the whole weight (SmolLM2's 49152 x 576 output in bf16: 54 MiB at once).
# Measured with 64 bf16 rows (2 cores, one thread): that output 70-76 ms whole, 26-32 ms in blocks of
# 2,048 rows, 60-64 ms (int4) in blocks of 1,024; ATen's int8 GEMM 120 ms, and 8.0 against 3.9-4.2 ms
# for a SmolLM2 layer's seven linears.
_BLOCK_BYTES = 5 << 19


def block_rows(k: int, dtype: torch.dtype) -> int:
    """Weight rows a wider step dequantizes at once on CPU: a power of two, at least 64, whose
    ``[rows, k]`` block in ``dtype`` fits ``_BLOCK_BYTES``."""
    rows = max(64, _BLOCK_BYTES // (k * torch.empty((), dtype=dtype).element_size()))
    return 1 << (rows.bit_length() - 1)


def in_row_blocks(form: Callable[..., torch.Tensor], x: torch.Tensor, block: Optional[int],
                   *weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``form(x, *weights)`` over blocks of ``block`` output rows (``None``: all at once), concatenated."""
    n = weights[0].shape[0]
    if block is None or n <= block:
        return form(x, *weights)
    return torch.cat([form(x, *(None if w is None else w[n0:n0 + block] for w in weights))
                      for n0 in range(0, n, block)], dim=-1)


def _int8_dequantized_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # torchao's own form: the weight dequantized in fp32 and rounded to x's dtype, then mm.
    return gemm(x, (qdata.float() * scale.float().unsqueeze(-1)).to(x.dtype))


def int8_many_rows(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                   block: Optional[int] = None) -> torch.Tensor:
    """Wider steps: the weight dequantized (``block`` rows at a time), then ``mm``. (ATen's int8 GEMM,
    which reads the int8 as stored, was 2x slower on a SmolLM2 layer in bf16 and scalar in fp32.)"""
    return in_row_blocks(_int8_dequantized_mm, x, block, qdata, scale)


def _int4_dots(xg: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # [R, 1, K/G, 2, G/2] x [N, K/G, G/2] -> [R, N]: sum of scale * (x_lo * lo + x_hi * hi), nibbles unsigned.
    p = packed.to(torch.int32)
    lo, hi = (p & 15).float(), (p >> 4).float()
    return ((xg[..., 0, :] * lo + xg[..., 1, :] * hi) * scale.float().unsqueeze(-1)).sum((-1, -2))


def int4_one_row(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: Optional[torch.Tensor]) -> torch.Tensor:
    """``[R, K]`` -> ``[R, N]``: the dequantised product for R == 1, weights read once as packed
    (written for any R, as ``int8_one_row``)."""
    _, groups, half = packed.shape
    xg = _fp32_rows(x).reshape(-1, 1, groups, 2, half)
    offset = 8.0 if zero is None else zero.float() + 8.0  # stored nibble = q + 8; w = (q - zero) * scale
    # sum_g scale * offset * sum(x over the group): the offset's share, once per group, not per weight.
    shift = (scale.float() * offset * xg.sum((-1, -2))).sum(-1)  # [R, N]
    return (_int4_dots(xg, packed, scale) - shift).to(x.dtype)


def int4_weight(packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """The dequantised ``[N, K]`` weight in ``dtype`` (computed in fp32, as torchao does)."""
    n, groups, half = packed.shape
    p = packed.to(torch.int32)
    q = torch.cat([p & 15, p >> 4], dim=-1).float() - 8.0  # [N, K/G, G]: inputs j and j + G/2 of each group
    if zero is not None:
        q = q - zero.float().unsqueeze(-1)
    return (q * scale.float().unsqueeze(-1)).reshape(n, groups * 2 * half).to(dtype)


def int4_many_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   zero: Optional[torch.Tensor], block: Optional[int] = None) -> torch.Tensor:
    """Wider steps: the low and the high nibbles dequantised as two ``[N, K/2]`` weights (``block`` rows
    at a time), each multiplied with the inputs it holds (64 x 1536 x 576 bf16: 0.36 ms, against 0.66
    ms for one interleaved ``[N, K]`` weight, whose select of a nibble per input inductor does not
    vectorise)."""
    return in_row_blocks(_int4_halves_mm, x, block, packed, scale, zero)


def _int4_halves_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zero: Optional[torch.Tensor]) -> torch.Tensor:
    n, groups, half = packed.shape
    xg = x.reshape(-1, groups, 2, half)
    offset = 8.0 if zero is None else zero.float().unsqueeze(-1) + 8.0
    sc = scale.float().unsqueeze(-1)
    lo = (((packed & 15).float() - offset) * sc).to(x.dtype).reshape(n, groups * half)
    hi = (((packed >> 4).float() - offset) * sc).to(x.dtype).reshape(n, groups * half)
    return (gemm(xg[:, :, 0].reshape(-1, groups * half), lo)
            + gemm(xg[:, :, 1].reshape(-1, groups * half), hi))


# --------------------------------------------------------------------------- #
# The ops (eager: the wider form, for any row count)
# --------------------------------------------------------------------------- #


@torch.library.custom_op("offgraph_kv::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return int8_many_rows(rows, qdata, scale).reshape(*x.shape[:-1], qdata.shape[0])


@int8_linear.register_fake
def _(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


@torch.library.custom_op("offgraph_kv::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                zero: Optional[torch.Tensor]) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return int4_many_rows(rows, packed, scale, zero).reshape(*x.shape[:-1], packed.shape[0])


@int4_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _dynamic_activation_op(name: str, torchao_form: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``offgraph_kv::<name>(x, packed, scale, sums)``, ``sums [N]`` one per output (the row sums of
    either layout); eager: torchao's form over ``x``'s rows."""
    def eager(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return torchao_form(rows, packed, scale, sums).reshape(*x.shape[:-1], sums.shape[0])

    op = torch.library.custom_op(f"offgraph_kv::{name}", eager, mutates_args=())
    op.register_fake(lambda x, packed, scale, sums: x.new_empty(*x.shape[:-1], sums.shape[0]))
    return op


int4_da8_linear = _dynamic_activation_op("int4_da8_linear", int4_da8_torchao_form)
int8_da8_linear = _dynamic_activation_op("int8_da8_linear", int8_da8_torchao_form)


# --------------------------------------------------------------------------- #
# Lowering
# --------------------------------------------------------------------------- #


def _kernel_or(reduction: Callable[..., torch.Tensor], kernel: Callable[..., torch.Tensor]) -> Callable[..., Callable[..., torch.Tensor]]:
    """The one-row form the export's mode asks for (``decode_gemv.kernel_takes``), chosen from the
    operands when traced."""
    from offgraph_kv.backend.decode_gemv import kernel_takes

    def form(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, *zero: torch.Tensor) -> Callable[..., torch.Tensor]:
        # The kernel reads the stored integers as laid out by pack_int4 / torchao (dense rows), x and
        # the scales as fp32 / bf16 / fp16.
        # SmolLM2 int8 / int4 steps with every linear on the kernel took 0.84-0.94x the reductions'
        # (benchmarks/results/cpu_decode_gemv_auto.md).
        return kernel if kernel_takes(x, scale, qdata, *zero, floats=2) else reduction
    return form


def _by_width(one_row: Callable[..., Callable[..., torch.Tensor]], many_rows: Callable[..., Callable[..., torch.Tensor]],
              reduce: bool) -> Callable[..., torch.Tensor]:
    """The lowering of one quantized linear from its one-row and wider forms' choosers (each takes the
    operands, returns the form): a branch on the width (``reduce``), none where both are one kernel."""
    def call(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        many = many_rows(rows, *weights)
        one = one_row(rows, *weights) if reduce else many
        out = by_width(rows.shape[0], one, many, (rows, *weights))
        return out.reshape(*lead, out.shape[-1])
    return call


def _wide(many_rows: Callable[..., torch.Tensor], kernel: Callable[..., torch.Tensor],
          cpu: bool) -> Callable[..., Callable[..., torch.Tensor]]:
    """A wider step's form: on CPU our kernel's GEMM where it takes the step (bf16 rows,
    ``decode_gemv.wide_kernel_takes``), else the weight dequantized ``block_rows`` rows at a time, then
    ``mm``; elsewhere the whole weight dequantized, then ``mm``."""
    from offgraph_kv.backend.decode_gemv import KERNEL_FLOATS, wide_kernel_takes

    def form(x: torch.Tensor, *weights: torch.Tensor) -> Callable[..., torch.Tensor]:
        if cpu and weights[1].dtype in KERNEL_FLOATS and wide_kernel_takes(x, *weights):
            return kernel
        return functools.partial(many_rows, block=block_rows(x.shape[-1], x.dtype) if cpu else None)
    return form


def _without_zero(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # torch.cond's operands must be tensors: a symmetric int4 linear's branches take no zero point.
    return lambda x, packed, scale, **options: fn(x, packed, scale, None, **options)


def _da8_on(cpu: bool, kernel: Callable[..., torch.Tensor],
            torchao_form: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A dynamic-activation lowering: our kernel for every width on CPU (where it takes ``x``'s dtype),
    else torchao's form."""
    from offgraph_kv.backend.decode_gemv import KERNEL_FLOATS

    def call(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        take = cpu and x.dtype in KERNEL_FLOATS and scale.dtype in KERNEL_FLOATS
        out = (kernel if take else torchao_form)(rows, packed, scale, sums)
        return out.reshape(*lead, out.shape[-1])
    return call


def lower_quantized_linears(program: fx.GraphModule, reduce: bool, cpu: bool = False) -> int:
    """Replace every quantized-linear op of ``program`` (in place) by its lowering; returns how many.
    ``reduce``: one-row steps as reductions (CPU), else the wider form for every width; ``cpu``:
    the program runs on CPU (the int8-activation kernel serves every width there)."""
    count = 0
    for node in list(program.graph.nodes):
        if node.op != "call_function":
            continue
        ops = torch.ops.offgraph_kv
        if node.target is ops.int8_linear.default:
            one = _kernel_or(int8_one_row, ops.int8_linear_rows)
            many = _wide(int8_many_rows, ops.int8_linear_rows, cpu)
            fn, args = _by_width(one, many, reduce), tuple(node.args)
        elif node.target is ops.int4_linear.default:
            x, packed, scale, zero = node.args
            if zero is None:
                one = _kernel_or(_without_zero(int4_one_row), ops.int4_linear_rows)
                many = _wide(_without_zero(int4_many_rows), ops.int4_linear_rows, cpu)
                args = (x, packed, scale)
            else:
                one = _kernel_or(int4_one_row, ops.int4z_linear_rows)
                many = _wide(int4_many_rows, ops.int4z_linear_rows, cpu)
                args = (x, packed, scale, zero)
            fn = _by_width(one, many, reduce)
        elif node.target is ops.int4_da8_linear.default:
            fn, args = _da8_on(cpu, ops.int4_da8_linear_rows, int4_da8_torchao_form), tuple(node.args)
        elif node.target is ops.int8_da8_linear.default:
            fn, args = _da8_on(cpu, ops.int8_da8_linear_rows, int8_da8_torchao_form), tuple(node.args)
        else:
            continue
        with program.graph.inserting_before(node):
            new = program.graph.call_function(fn, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        program.graph.erase_node(node)
        count += 1
    program.recompile()
    return count
