"""How a GEMM launch picks its tile among a tier's candidates: one rule, shared by the 16-bit and fp8 GEMM
launchers (:func:`llm_speed.matmul.gemm_configs.gemm_config`, :func:`llm_speed.matmul.fp8.gemm_fp8_config`)
and the analytic model that restates their choice (:mod:`llm_speed.perf.predict`). Torch-free.

A tile is ``(block_m, block_n, block_k)``. The rule, in three steps:

1. **No tile larger than the problem.** M and N are padded to a power of two, at least
   :data:`SMALLEST_TILE_SIDE` (tl.dot's smallest side); a tile side may exceed its padded side only by being
   the smallest such side the candidates have (M = 1 gets the smallest BLOCK_M, not a 128-row tile of which
   127 rows are masked). When no candidate meets both sides, the one of smallest BLOCK_M (then BLOCK_N).
2. **Decode (every row in one row block of the smallest BLOCK_M): the weights' bytes.** There a GEMM does
   at most BLOCK_M FLOPs per weight byte, below every GPU's ridge (the H100's is 295 FLOP/B), and only
   programs spread over all SMs read the weights at full bandwidth. Each tile reads ``block_n x K`` weight
   elements, and starting one costs about :data:`TILE_START_BYTES` more (its pipeline fills); the tile
   whose busiest SM reads the fewest such bytes wins, the widest on a tie (fewer programs re-reading the
   activations).
3. **Otherwise: least modelled compute time.** ``tiles = cdiv(m, BM) * cdiv(n, BN) * batch`` programs run in
   ``waves = cdiv(tiles, SMs)`` rounds; a round takes a tile's work, padding included (``BM * BN *
   cdiv(k, BK) * BK``), divided by the tile's efficiency ``I / (I + 32)`` with ``I = BM*BN / (BM+BN)``, the
   FLOPs per operand element a tile loads per K step: 128x256 runs at 73% of the tensor cores' peak in this
   model, 128x128 at 67%, 64x64 at 50%. The first of the candidates (largest first) wins a tie. Tiles a
   tier ships for decode alone are left out here unless nothing else fits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from llm_speed.core.intmath import cdiv, next_power_of_2

# tl.dot's smallest tile side: problem sides are padded to a power of two at least this.
SMALLEST_TILE_SIDE = 16
# A tile of intensity I = BM*BN / (BM+BN) (FLOPs per operand element loaded, per K step) runs at
# I / (I + TILE_INTENSITY_AT_HALF) of the tensor cores' peak in the compute rule.
TILE_INTENSITY_AT_HALF = 32
# What starting a tile costs a decode GEMM, in weight bytes an SM could have read meanwhile: its pipeline
# fills once per tile (the persistent kernel's loop over K restarts for each tile), about one HBM latency
# (~1 us) at an SM's share of the bandwidth (H100 SXM: 3.35 TB/s over 132 SMs, ~25 GB/s). An estimate, not
# yet measured.
TILE_START_BYTES = 32 * 1024
# Block-scaled fp8 GEMMs keep two fp32 tiles live (the step's product and the accumulator): a tile whose
# accumulator takes more than this many registers per thread would need 2x that and spill (seen compiling for
# sm_90a: 128x128 on 4 warps and 128x256 on 8 reach 255 registers and a 224-344 byte stack).
BLOCK_SCALED_ACC_REGISTERS = 64


def fits_block_scaling(block_m: int, block_n: int, warps: int) -> bool:
    """Whether a ``block_m x block_n`` tile on ``warps`` warps holds block scaling's two fp32 tiles
    (:data:`BLOCK_SCALED_ACC_REGISTERS` per thread for one): the fp8 GEMM launcher's candidates and the
    analytic model's."""
    return block_m * block_n <= BLOCK_SCALED_ACC_REGISTERS * 32 * warps


def tile_efficiency(block_m: int, block_n: int) -> float:
    """The compute rule's fraction of the tensor cores' peak a ``block_m x block_n`` tile runs at."""
    intensity = block_m * block_n / (block_m + block_n)
    return intensity / (intensity + TILE_INTENSITY_AT_HALF)


def choose_tile(m: int, n: int, k: int, tiles: Sequence[Sequence[int]], sms: int, *, batch: int = 1,
                element_bytes: int = 2, decode_only: Collection[int] = ()) -> int:  # fmt: skip
    """The index in ``tiles`` (``(block_m, block_n, block_k, ...)`` each, largest first) of the tile a
    GEMM of ``batch x [m, k] @ [k, n]`` with ``element_bytes`` operands takes on ``sms`` SMs (the module's
    rule); ``decode_only``: indices of tiles only the decode step takes (or nothing else fits)."""
    smallest_m = min(t[0] for t in tiles)
    max_m = max(next_power_of_2(max(m, SMALLEST_TILE_SIDE)), smallest_m)
    max_n = max(next_power_of_2(max(n, SMALLEST_TILE_SIDE)), min(t[1] for t in tiles))
    fitting = [i for i, t in enumerate(tiles) if t[0] <= max_m and t[1] <= max_n]
    if not fitting:
        return min(range(len(tiles)), key=lambda i: (tiles[i][0], tiles[i][1]))

    def waves(t) -> int:
        return cdiv(cdiv(m, t[0]) * cdiv(n, t[1]) * batch, sms)

    if m <= smallest_m:  # decode: the weights' bytes on the busiest SM

        def weight_bytes(i: int) -> tuple[int, int]:
            block_n = tiles[i][1]
            return waves(tiles[i]) * (block_n * k * element_bytes + TILE_START_BYTES), -block_n

        return min(fitting, key=weight_bytes)

    def compute(i: int) -> float:
        bm, bn, bk = tiles[i][:3]
        return waves(tiles[i]) * bm * bn * max(cdiv(k, bk), 1) * bk / tile_efficiency(bm, bn)

    # Decode tiles (64x32): on more rows their many programs re-read the activations and the weights
    # through L2, which this rule does not price; taken only when nothing else fits.
    rest = [i for i in fitting if i not in decode_only]
    return min(rest or fitting, key=compute)  # min keeps the first of equal times
