"""CUDA update-and-attend kernels of our own (Triton), compiled into the program's shared object.

One op per step and layer, ``offgraph_kv::update_attend``, registered with
``torch.library.triton_op``: export keeps it as one custom-op node (so the
program stays serialisable on its way to the compiling process), and
AOTInductor decomposes it into its two Triton launches and embeds their cubins
in the ``.so``; nothing Python runs at step time.

What the kernels take (the contract the runtime meets, see docs/architecture.md):

- the bound storage as it is (flat: ``[1, S, H_kv, D]`` with ``S >= length + T``;
  ring: the whole ring ``[1, slots, H_kv, D]``); its extent is only a bound,
- the committed length as an int64 ``[1]`` tensor in device memory. Every
  position is ``length + i`` for query row ``i``; nothing about the length is
  read from a shape, so the same launch with the same arguments is right for any
  length the bound storage holds (what CUDA-graph replay needs),
- this step's K/V ``[1, H_kv, T, D]`` and queries ``[1, H_q, T, D]``; ``T`` is
  a shape (one captured graph per width).

Launch 1, ``_update_attend_partial``, grid ``(splits, H_kv, row_blocks)``:
each program owns one KV head, one block of folded query rows (row
``r = i * G + g`` is token ``i`` of that head's ``g``-th query head, so a KV row
is read once per KV head group, GQA native) and one contiguous share of the
key range the block can see (flat: ``0 .. length + T``, lower-right causal per
row; ring: ``length - window + 1 ..``, the band by position, each position at
slot ``position mod slots``). Keys before ``length`` come from storage, in a
loop of plain strided loads (a ring computes one slot per block: a block wraps
at most once); the step's own keys come straight from the ``k``/``v`` inputs
in a second loop, so no program waits for another's write. Split 0 of row
block 0 also writes the step's K/V rows into storage (flat: rows ``length + j``;
ring: slots ``(length + j) mod slots``, two runs when it wraps). Those rows are
never read by this launch: flat rows ``>= length`` come from the inputs, and a
ring has ``slots >= window + T - 1``, so the slots it overwrites held positions
no query of this step can see. Each program keeps an online softmax in fp32
(base 2) and leaves its partial output, max and sum. The kernel is compiled
twice: 16-row blocks for narrow steps (up to 64 folded rows: decode), 64-row
blocks for wide ones (prefill chunks: each key block read once per 64 rows).
Both are launched every step and the idle one has a grid of zero programs,
which the launcher skips: the width is a symbolic shape, so the choice is made
on the device side of the launch, not at export.

One-token steps (decode) take a third variant, ``_decode_partial``, grid
``(splits, H_kv)``, on the CUDA cores: a KV head's ``G`` query rows against each
key block as broadcast products summed in fp32 (a 16-row ``tl.dot`` tile is
mostly padding at decode and its operand staging caps the programs per SM), the
same ranges, write and partials as above. Which layer kinds take it, and with
what launch settings, is ``DECODE`` (``benchmarks/cuda/decode_variants.py``
measures the choice); the other two variants then have grids of zero programs
at width 1.

Launch 2, ``_combine``, grid ``(T * G, H_kv)``, merges one row's partials
from every split in one tile (a single round of loads) and writes the
output, ``[1, T, H_q, D_v]`` memory seen as ``[1, H_q, T, D_v]`` (the layout
the output projection reads without a copy). Where the keys were not split (one split: wide steps,
mostly), launch 1 normalises and writes the output itself and this launch
has a grid of zero programs.

Splits: ``max(1, 2 * SMs // (H_kv * row_blocks))``, so one batch-1 decode step
launches about two programs per multiprocessor (ring layers' narrow steps: three, with
32-key blocks, see ``RING_PROGRAMS_PER_SM``); a split's share of the keys is
computed in the kernel from the length it reads, rounded to whole key blocks,
and splits past the end exit at once. Wide steps (prefill chunks) get their
parallelism from row blocks instead and fall to one split.
"""

from __future__ import annotations

import os

import torch

from offgraph_kv.backend.switches import switch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    HAVE_TRITON = True
except ImportError:  # CI installs no triton: the CUDA kernels are simply unavailable there
    HAVE_TRITON = False

BLOCK_M = 16  # folded query rows per program: the smallest tl.dot tile, a decode group (G <= 16) fits one
BLOCK_N = 64  # keys per inner step
PROGRAMS_PER_SM = 2
NUM_WARPS = 4
NUM_STAGES = 3
WIDE_ROWS = 64  # steps with more folded query rows than this take the wide variant
WIDE_BLOCK_M = 64  # the H200 sweep's best for 512-token chunks (cuda_kernels_h200.md)
WIDE_BLOCK_N = 64
WIDE_NUM_WARPS = 4
WRITE_ROWS = 16  # tokens per tile of the step's K/V write (decode writes one: a 64-row tile was mostly masked work)
# Narrow steps of ring layers: a band of at most ``window`` keys, short enough that a
# program's fixed instructions set its time, gains from more, shorter programs (the H200
# ring sweep's best, 4,096 keys: 10.5 -> 9.4 us); flat decode at 32K-128K loses with
# them (38 -> 43 us, 125 -> 150 us), so flat layers keep the settings above.
RING_PROGRAMS_PER_SM = 3
RING_BLOCK_N = 32
RING_NUM_STAGES = 2
# One-token steps (decode) on the CUDA cores, ``_decode_partial``: (programs per SM,
# keys per block, warps, stages) per layer kind; None leaves that kind's decode on
# the 16-row tl.dot kernel above. Off by default until the H200 sweep
# (``benchmarks/cuda/decode_variants.py``) has chosen settings: the kernel is
# checked against the reference (Triton's interpreter) but not yet timed.
DECODE = {"flat": None, "ring": None}
_DEFAULT_SMS = 132  # an H200's count, for tracing off the GPU (the interpreter tests)

# At export, "torch" keeps CUDA 16-bit programs on torch's attention ops (the
# path before these kernels, kept for comparison); "triton", the default, uses
# these kernels wherever they apply.
ENV_SWITCH = "OFFGRAPH_KV_CUDA_ATTENTION"


def kernels_apply(device: str, storage_dtype: torch.dtype) -> bool:
    """Whether a program for ``device`` with this storage dtype attends through these kernels.

    CUDA with 16-bit storage, where Triton is installed, unless
    ``OFFGRAPH_KV_CUDA_ATTENTION=torch``: every other program keeps the torch path.
    """
    choice = switch(ENV_SWITCH, ("triton", "torch"), "triton")
    return HAVE_TRITON and device == "cuda" and storage_dtype in (torch.bfloat16, torch.float16) and choice == "triton"


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def _interpreted_bf16(dtype: torch.dtype) -> bool:
    # Triton's CPU interpreter (3.7) returns garbage from tl.dot on bf16 operands;
    # there the products are taken in fp32 instead (same bf16 inputs, same
    # fp32 accumulation). Compiled kernels always take the 16-bit dot.
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())  # at least 16: tl.dot's smallest extent


if HAVE_TRITON:

    @triton.jit
    def _attend_block(q, k, v, kp, k_ok, qpos, m_i, l_i, acc, scale_log2, window,
                      RING: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr):
        # One key block into the running softmax (base 2, fp32 state).
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        # AOTInductor passes the scale as fp64: keep the softmax state fp32.
        s = (s * scale_log2).to(tl.float32)
        seen = k_ok[None, :]
        if CAUSAL:
            seen = seen & (kp[None, :] <= qpos[:, None])
        if RING:
            seen = seen & (kp[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _head_rows(KS, VS, LEN, h, sks_h, svs_h, slots, RING: tl.constexpr):
        # The committed length (from device memory), KV head h's first stored rows, and a
        # ring's slot of the length: ``length mod slots``, a program's one 64-bit division.
        length = tl.load(LEN).to(tl.int64)
        if RING:
            len_slot = (length % slots).to(tl.int32)
        else:
            len_slot = 0
        return length, KS + h * sks_h, VS + h * svs_h, len_slot

    @triton.jit
    def _stored_block(k_head, v_head, length, len_slot, k0, stored_end, nb, d, dv, d_ok, dv_ok,
                      sks_r, svs_r, slots, RING: tl.constexpr):
        # One block of stored keys and values from position ``length + k0`` on. A ring's
        # slots follow the position and a block spans at most ``slots`` positions, so it
        # wraps at most once: its first slot by one conditional add, no division.
        k_ok = k0 + nb < stored_end
        if RING:
            s0 = len_slot + k0  # in (-slots, slots): -window < k0 < 0
            s0 = tl.where(s0 < 0, s0 + slots, s0)
            off = s0 + nb
            off = tl.where(off >= slots, off - slots, off) - s0  # rows from the block's first slot
            k_blk = k_head + s0.to(tl.int64) * sks_r
            v_blk = v_head + s0.to(tl.int64) * svs_r
        else:
            off = nb
            k_blk = k_head + (length + k0) * sks_r
            v_blk = v_head + (length + k0) * svs_r
        k = tl.load(k_blk + off[:, None] * sks_r + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_blk + off[:, None] * svs_r + dv[None, :], mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
        return k, v, k_ok

    @triton.jit
    def _update_attend_partial(
        Q, KN, VN, KS, VS, LEN, ACC, MAX, SUM, OUT, so_t, so_h,
        sq_h, sq_t, sq_d, skn_h, skn_t, skn_d, svn_h, svn_t, svn_d,
        sks_r, sks_h, svs_r, svs_h,
        T, slots, window, n_splits, scale_log2,
        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
        RING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
        WRITE_ROWS: tl.constexpr,
    ):
        split = tl.program_id(0)
        h = tl.program_id(1)
        mb = tl.program_id(2)
        n_kv = tl.num_programs(1)
        length, k_head, v_head, len_slot = _head_rows(KS, VS, LEN, h, sks_h, svs_h, slots, RING=RING)
        n_rows = T * G

        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        d_ok = d < D
        dv_ok = dv < DV
        nb = tl.arange(0, BLOCK_N)
        # Positions are taken relative to the length (int32: a step's band and a split's
        # range are far below 2**31), and row addresses as one 64-bit base per block plus
        # 32-bit offsets in it: 64-bit products and divisions per element were most of
        # the instructions of a decode step, whose programs are short enough for their
        # instruction latency to set the time. A ring's slot arithmetic starts from
        # ``length mod slots``, the one 64-bit division.

        # The step's write: split 0 of each row block writes the tokens whose first
        # folded row it holds (every token once, spread over the row blocks), in tiles
        # of WRITE_ROWS tokens (a decode step writes one).
        if split == 0:
            nw = tl.arange(0, WRITE_ROWS)
            j_end = tl.minimum((mb * BLOCK_M + BLOCK_M + G - 1) // G, T)
            for j0 in range((mb * BLOCK_M + G - 1) // G, j_end, WRITE_ROWS):
                j = j0 + nw
                j_ok = j < j_end
                if RING:
                    dest = len_slot + j  # < 2 * slots: j < T <= slots
                    dest = tl.where(dest >= slots, dest - slots, dest)
                    k_dst = k_head + dest[:, None] * sks_r
                    v_dst = v_head + dest[:, None] * svs_r
                else:
                    k_dst = k_head + length * sks_r + j[:, None] * sks_r
                    v_dst = v_head + length * svs_r + j[:, None] * svs_r
                kk = tl.load(KN + h * skn_h + j[:, None] * skn_t + d[None, :] * skn_d,
                             mask=j_ok[:, None] & d_ok[None, :])
                tl.store(k_dst + d[None, :], kk, mask=j_ok[:, None] & d_ok[None, :])
                vv = tl.load(VN + h * svn_h + j[:, None] * svn_t + dv[None, :] * svn_d,
                             mask=j_ok[:, None] & dv_ok[None, :])
                tl.store(v_dst + dv[None, :], vv, mask=j_ok[:, None] & dv_ok[None, :])

        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        tok = rows // G
        qh = h * G + rows % G
        qrel = tok  # each query row's position, less the length

        # Keys this row block can see (relative): up to its last token; a ring's band from its first token's.
        first_tok = (mb * BLOCK_M) // G
        last_tok = (tl.minimum(mb * BLOCK_M + BLOCK_M, n_rows) - 1) // G
        hi = last_tok + 1
        lo = -(tl.minimum(length, 2**31 - 1 - T).to(tl.int32))  # position 0
        if RING:
            lo = tl.maximum(first_tok - window + 1, lo)
        per_split = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, hi)

        q = tl.load(Q + qh[:, None] * sq_h + tok[:, None] * sq_t + d[None, :] * sq_d,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row that sees nothing here gives 0, not NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BDV], tl.float32)
        # Keys before the length come from storage: every query sees them (flat),
        # or those in its band (ring).
        stored_end = tl.minimum(end, 0)
        for k0 in range(start, stored_end, BLOCK_N):
            k, v, k_ok = _stored_block(k_head, v_head, length, len_slot, k0, stored_end, nb, d, dv, d_ok, dv_ok,
                                       sks_r, svs_r, slots, RING=RING)
            m_i, l_i, acc = _attend_block(q, k, v, k0 + nb, k_ok, qrel, m_i, l_i, acc, scale_log2, window,
                                          RING=RING, CAUSAL=False, DOT_F32=DOT_F32)
        # The step's own keys come straight from its inputs (no program waits for
        # another's write), lower-right causal.
        for k0 in range(tl.maximum(start, 0), end, BLOCK_N):
            kp = k0 + nb
            k_ok = kp < end
            k = tl.load(KN + h * skn_h + kp[:, None] * skn_t + d[None, :] * skn_d,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(VN + h * svn_h + kp[:, None] * svn_t + dv[None, :] * svn_d,
                        mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, kp, k_ok, qrel, m_i, l_i, acc, scale_log2, window,
                                          RING=RING, CAUSAL=True, DOT_F32=DOT_F32)

        if n_splits == 1:
            # The whole key range in this program: normalise and write the output
            # (the combine launch has a grid of zero programs then).
            out = acc / l_i[:, None]
            tl.store(OUT + tok[:, None] * so_t + qh[:, None] * so_h + dv[None, :], out.to(OUT.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok[None, :])
        else:
            part = (split * n_kv + h) * n_rows + rows
            tl.store(MAX + part, m_i, mask=row_ok)
            tl.store(SUM + part, l_i, mask=row_ok)
            tl.store(ACC + part[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & dv_ok[None, :])

    @triton.jit
    def _decode_partial(
        Q, KN, VN, KS, VS, LEN, ACC, MAX, SUM, OUT, so_h,
        sq_h, sq_d, skn_h, skn_d, svn_h, svn_d, sks_r, sks_h, svs_r, svs_h,
        slots, window, n_splits, scale_log2,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
        BDV: tl.constexpr, RING: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # A one-token step on the CUDA cores: a KV head's G query rows against a
        # block of keys as broadcast products summed in fp32, no tensor-core tile
        # (a 16-row tl.dot tile is 3/4 padding at G = 4 and its operand staging
        # holds registers and shared memory that cap the programs per SM, while a
        # decode program is short enough for its instruction latency to set the time).
        split = tl.program_id(0)
        h = tl.program_id(1)
        n_kv = tl.num_programs(1)
        length, k_head, v_head, len_slot = _head_rows(KS, VS, LEN, h, sks_h, svs_h, slots, RING=RING)
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        d_ok = d < D
        dv_ok = dv < DV
        g = tl.arange(0, GP)
        g_ok = g < G
        nb = tl.arange(0, BLOCK_N)
        if RING:
            row = len_slot  # the step's row: its slot, or the length
        else:
            row = length
        k_row = k_head + row * sks_r
        v_row = v_head + row * svs_r
        k_new = tl.load(KN + h * skn_h + d * skn_d, mask=d_ok, other=0.0)
        v_new = tl.load(VN + h * svn_h + dv * svn_d, mask=dv_ok, other=0.0)
        if split == 0:
            # The step's row, which no program reads back: its key comes from the input below.
            tl.store(k_row + d, k_new, mask=d_ok)
            tl.store(v_row + dv, v_new, mask=dv_ok)

        # Positions relative to the length: stored keys are -length .. -1 (a ring's
        # band from 1 - window), the step's own key is 0.
        lo = -(tl.minimum(length, 2**31 - 2).to(tl.int32))
        if RING:
            lo = tl.maximum(1 - window, lo)
        per_split = tl.cdiv(tl.cdiv(1 - lo, n_splits), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, 1)
        stored_end = tl.minimum(end, 0)

        qh = h * G + g
        q = tl.load(Q + qh[:, None] * sq_h + d[None, :] * sq_d, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        q = (q.to(tl.float32) * scale_log2).to(tl.float32)
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BDV], tl.float32)
        for k0 in range(start, stored_end, BLOCK_N):
            k, v, k_ok = _stored_block(k_head, v_head, length, len_slot, k0, stored_end, nb, d, dv, d_ok, dv_ok,
                                       sks_r, svs_r, slots, RING=RING)
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
            s = tl.where(k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        if (start <= 0) & (end > 0):
            # The split whose range holds position 0 takes the step's own key.
            s = tl.sum(q * k_new.to(tl.float32)[None, :], 1)
            m_new = tl.maximum(m_i, s)
            p = tl.exp2(s - m_new)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
            l_i = l_i * alpha + p
            m_i = m_new

        if n_splits == 1:
            tl.store(OUT + qh[:, None] * so_h + dv[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                     mask=g_ok[:, None] & dv_ok[None, :])
        else:
            part = (split * n_kv + h) * G + g
            tl.store(MAX + part, m_i, mask=g_ok)
            tl.store(SUM + part, l_i, mask=g_ok)
            tl.store(ACC + part[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])

    @triton.jit
    def _combine(
        ACC, MAX, SUM, OUT, so_t, so_h, T, n_splits,
        G: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # One program per (folded row, KV head): all splits' partials in one tile,
        # so the merge is one round of loads, not a loop of dependent ones.
        row = tl.program_id(0)
        h = tl.program_id(1)
        n_kv = tl.num_programs(1)
        n_rows = T * G
        sp = tl.arange(0, BLOCK_S)
        sp_ok = sp < n_splits
        dv = tl.arange(0, BDV)
        part = (sp * n_kv + h) * n_rows + row
        m_s = tl.load(MAX + part, mask=sp_ok, other=-1.0e30)
        l_s = tl.load(SUM + part, mask=sp_ok, other=0.0)
        a_s = tl.load(ACC + part[:, None] * DV + dv[None, :], mask=sp_ok[:, None] & (dv < DV)[None, :], other=0.0)
        m = tl.max(m_s, 0)
        w = tl.exp2(m_s - m)
        # Every row sees at least one key (flat: position 0; ring: its own), so the sum is > 0.
        out = tl.sum(a_s * w[:, None], 0) / tl.sum(l_s * w, 0)
        tok = row // G
        qh = h * G + row % G
        tl.store(OUT + tok * so_t + qh * so_h + dv, out.to(OUT.dtype.element_ty), mask=dv < DV)

    @triton_op("offgraph_kv::update_attend", mutates_args={"k_store", "v_store"})
    def update_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                      v_store: torch.Tensor, length: torch.Tensor, window: int, scale: float,
                      out_dtype: torch.dtype) -> torch.Tensor:
        """Write this step's K/V at the committed length and attend (``window > 0``: a ring).

        ``q [1, H_q, T, D]``, ``k [1, H_kv, T, D]``, ``v [1, H_kv, T, D_v]``,
        storage ``[1, S, H_kv, D]`` (16-bit, last two dims dense), ``length``
        int64 ``[1]`` on the same device. Returns ``[1, H_q, T, D_v]`` in ``out_dtype``.
        """
        _, hq, t, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        g = hq // hkv
        # Attention reads 16-bit storage as is (fp32 accumulation): queries and the
        # step's K/V in the storage dtype, which is what the stored rows will hold.
        q = q.to(k_store.dtype)
        k = k.to(k_store.dtype)
        v = v.to(v_store.dtype)
        n_rows = t * g
        # Two variants of the partial kernel, one launched per step: the width is
        # a shape the program leaves symbolic, so both launches are compiled in
        # and the idle one gets a grid of zero programs, which AOTInductor's
        # launcher skips (no kernel runs). Narrow steps (decode) fold up to 64
        # query rows into 16-row blocks and spread the keys over splits; wide
        # steps (prefill chunks) take 64-row blocks, so each key block is read
        # once per 64 rows and the dot products are large enough for the
        # tensor cores' warp-group instructions.
        wide = torch.sym_min(1, (n_rows - 1) // WIDE_ROWS)
        ring = window > 0
        sms = _multiprocessors(q.device)
        scale_log2 = scale * 1.4426950408889634  # the kernels' softmax is base 2
        programs = PROGRAMS_PER_SM * sms
        narrow_programs = (RING_PROGRAMS_PER_SM if ring else PROGRAMS_PER_SM) * sms
        narrow_blocks = (n_rows + BLOCK_M - 1) // BLOCK_M
        wide_blocks = (n_rows + WIDE_BLOCK_M - 1) // WIDE_BLOCK_M
        decode = DECODE["ring" if ring else "flat"]
        one = 0 if decode is None else 1 - torch.sym_min(1, t - 1)  # a one-token step takes _decode_partial
        decode_programs = 0 if decode is None else decode[0] * sms
        narrow_splits = (1 - wide) * (1 - one) * torch.sym_max(1, narrow_programs // (hkv * narrow_blocks))
        wide_splits = wide * torch.sym_max(1, programs // (hkv * wide_blocks))
        decode_splits = one * max(1, decode_programs // hkv)
        splits = narrow_splits + wide_splits + decode_splits
        acc = torch.empty((splits, hkv, n_rows, dv), device=q.device, dtype=torch.float32)
        mx = torch.empty((splits, hkv, n_rows), device=q.device, dtype=torch.float32)
        sm = torch.empty((splits, hkv, n_rows), device=q.device, dtype=torch.float32)
        out = torch.empty((1, t, hq, dv), device=q.device, dtype=out_dtype)
        args = (q, k, v, k_store, v_store, length, acc, mx, sm, out, out.stride(1), out.stride(2),
                q.stride(1), q.stride(2), q.stride(3), k.stride(1), k.stride(2), k.stride(3),
                v.stride(1), v.stride(2), v.stride(3),
                k_store.stride(1), k_store.stride(2), v_store.stride(1), v_store.stride(2),
                t, k_store.shape[1], window, splits, scale_log2)
        shape = dict(G=g, D=d, DV=dv, BD=_next_pow2(d), BDV=_next_pow2(dv), RING=ring,
                     DOT_F32=_interpreted_bf16(k_store.dtype), WRITE_ROWS=WRITE_ROWS)
        # The zero-able extent is the grid's first: launchers skip a launch when it is 0.
        wrap_triton(_update_attend_partial)[(narrow_splits, hkv, narrow_blocks)](
            *args, BLOCK_M=BLOCK_M, BLOCK_N=RING_BLOCK_N if ring else BLOCK_N, num_warps=NUM_WARPS,
            num_stages=RING_NUM_STAGES if ring else NUM_STAGES, **shape)
        wrap_triton(_update_attend_partial)[(wide_splits, hkv, wide_blocks)](
            *args, BLOCK_M=WIDE_BLOCK_M, BLOCK_N=WIDE_BLOCK_N, num_warps=WIDE_NUM_WARPS, num_stages=NUM_STAGES,
            **shape)
        if decode is not None:
            wrap_triton(_decode_partial)[(decode_splits, hkv)](
                q, k, v, k_store, v_store, length, acc, mx, sm, out, out.stride(2),
                q.stride(1), q.stride(3), k.stride(1), k.stride(3), v.stride(1), v.stride(3),
                k_store.stride(1), k_store.stride(2), v_store.stride(1), v_store.stride(2),
                k_store.shape[1], window, splits, scale_log2,
                G=g, GP=1 << (g - 1).bit_length(), D=d, DV=dv, BD=_next_pow2(d), BDV=_next_pow2(dv), RING=ring,
                BLOCK_N=decode[1], num_warps=decode[2], num_stages=decode[3])
        # Partials to merge only where the keys were split.
        wrap_triton(_combine)[(n_rows * torch.sym_min(1, splits - 1), hkv)](
            acc, mx, sm, out, out.stride(1), out.stride(2), t, splits,
            G=g, DV=dv, BDV=_next_pow2(dv), BLOCK_S=_next_pow2(max(1, max(programs, narrow_programs, decode_programs) // hkv)),
            num_warps=4,
        )
        return out.transpose(1, 2)


def reference_update_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                            v_store: torch.Tensor, length: int, window: int, scale: float,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """What ``update_attend`` computes, in plain PyTorch (fp32 arithmetic, GQA by repetition).

    Writes the step's rows into storage (flat: rows ``length + j``; ring: slots
    ``(length + j) mod slots``) and attends positions ``p`` with
    ``p <= length + i`` (and, for a ring, ``p > length + i - window``).
    """
    _, hq, t, _ = q.shape
    hkv = k.shape[1]
    slots = k_store.shape[1]
    dev = k_store.device
    pos = torch.arange(length, length + t, device=dev)
    dest = pos % slots if window > 0 else pos
    k_store[0, dest] = k[0].transpose(0, 1).to(k_store.dtype)
    v_store[0, dest] = v[0].transpose(0, 1).to(v_store.dtype)
    lo = max(0, length + t - slots) if window > 0 else 0
    key_pos = torch.arange(lo, length + t, device=dev)
    rows = key_pos % slots if window > 0 else key_pos
    keys = k_store[0, rows].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [H_q, P, D]
    values = v_store[0, rows].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
    logits = torch.matmul(q[0].to(k_store.dtype).float(), keys.transpose(1, 2)) * scale  # [H_q, T, P]
    qp = pos.unsqueeze(1)
    seen = key_pos.unsqueeze(0) <= qp
    if window > 0:
        seen &= key_pos.unsqueeze(0) > qp - window
    logits = logits.masked_fill(~seen, float("-inf"))
    return torch.matmul(torch.softmax(logits, -1), values).unsqueeze(0).to(out_dtype)
