"""GGUF block-quantized weights in the layout of specair's block kernels (blocks.h): unpacked from the bytes a
GGUF file stores, repacked by tiles of 16 output columns, every code and scale as stored (nothing re-rounded).

A GGUF row of K weights is K/32 (or K/256) blocks side by side, so rows can be permuted or concatenated freely
before packing (llama.cpp's q/k row order, fused q/k/v projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE, BLOCK, SUPER = 16, 32, 8
ROWS_PER_CHUNK = 4096  # packing works through this many rows at a time, so a large LM head needs little memory


@dataclass(frozen=True)
class Format:
    """One block format: GGUF's block (`qk` weights in `nbytes` bytes) and the kernel's record per tile and block
    of 32 (`record` bytes) and per tile and super-block of 256 (`super`, 0 where there is none)."""

    name: str
    qk: int
    nbytes: int
    bits: int
    record: int
    super: int

    @property
    def k_step(self) -> int:
        """K must be a multiple of this."""
        return BLOCK * SUPER if self.super else BLOCK

    @property
    def bits_per_weight(self) -> float:
        """What the kernel's layout stores per weight (GGUF's own size for every format but Q4_K and Q5_K, whose
        integer scales take a byte each here instead of 6 bits)."""
        return 8 * (self.record / (TILE * BLOCK) + self.super / (TILE * BLOCK * SUPER))


FORMATS = {f.name: f for f in (
    Format("Q4_0", 32, 18, 4, 288, 0), Format("Q4_1", 32, 20, 4, 320, 0), Format("Q5_0", 32, 22, 5, 352, 0),
    Format("Q5_1", 32, 24, 5, 384, 0), Format("Q8_0", 32, 34, 8, 544, 0), Format("Q4_K", 256, 144, 4, 288, 64),
    Format("Q5_K", 256, 176, 5, 352, 64), Format("Q6_K", 256, 210, 6, 416, 32),
    # float weights (a quantized file's float tensors, or exact dequantizations of types not read natively)
    Format("F16", 1, 2, 16, 1024, 0), Format("F32", 1, 4, 32, 2048, 0),
)}
FLOAT_FORMATS = ("F16", "F32")


@dataclass
class PackedWeight:
    """A [N, K] weight in the kernel's layout: records [tiles, K/32, record] and super [tiles, K/256, super]
    (None for formats without super-blocks)."""

    format: str
    N: int
    K: int
    records: np.ndarray
    super: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.records.nbytes + (0 if self.super is None else self.super.nbytes)


@dataclass
class Unpacked:
    """Codes [N, K] (Q8_0: its signed bytes as uint8) and the kernel's per-column parameters: `block`, fields
    [N, K/32] (float16, uint8 or int8) in the order a record holds them, and `sup`, fields [N, K/256]."""

    codes: np.ndarray
    block: list[np.ndarray]
    sup: list[np.ndarray]

    def rows(self, r0: int, r1: int) -> "Unpacked":
        return Unpacked(self.codes[r0:r1], [a[r0:r1] for a in self.block], [a[r0:r1] for a in self.sup])


def _half(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-block -> [..., 32] codes: low nibbles first, then high nibbles (Q4_0 ... Q5_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and minima [..., 8] (llama.cpp's get_scale_min_k4)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def unpack(name: str, raw: np.ndarray, K: int) -> Unpacked:
    """GGUF rows [N, K/qk * nbytes] bytes of format `name` -> codes and the kernel's parameters."""
    f = FORMATS[name]
    N = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(N, K // f.qk, f.nbytes)
    if f.qk == BLOCK:
        d = _half(b[..., 0:2])
        with_min = name in ("Q4_1", "Q5_1")
        q0 = 4 if with_min else 2
        if name == "Q8_0":
            codes = b[..., 2:34]
        elif f.bits == 4:
            codes = _nibbles(b[..., q0:q0 + 16])
        else:  # bit e of the little-endian qh is element e's fifth bit
            qh = np.ascontiguousarray(b[..., q0:q0 + 4]).view("<u4")
            high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            codes = _nibbles(b[..., q0 + 4:q0 + 20]) | (high << 4)
        return Unpacked(codes.reshape(N, K), [d, _half(b[..., 2:4])] if with_min else [d], [])
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])
        qs = (b[..., 16:144] if name == "Q4_K" else b[..., 48:176]).reshape(N, -1, 4, 32)
        # group g of 64 weights: low nibbles are sub-block 2g, high nibbles 2g+1
        codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(N, -1, 256)
        if name == "Q5_K":  # bit j of qh[l] is element 32j + l's fifth bit
            qh = b[..., 16:48]
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = codes | (high << 4).reshape(N, -1, 256)
        return Unpacked(codes.reshape(N, K), [sc.reshape(N, -1), mn.reshape(N, -1)], [d, dmin])
    if name == "Q6_K":
        ql, qh = b[..., 0:128].reshape(N, -1, 2, 2, 32), b[..., 128:192].reshape(N, -1, 2, 32)
        low = np.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
        high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=-2)
        codes = (low | (high << 4)).reshape(N, K)  # element 128n + 32k + l
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(N, -1, 2)  # per 16 weights
        return Unpacked(codes, [sc[..., 0], sc[..., 1]], [_half(b[..., 208:210])])
    raise ValueError(f"no block format {name!r}")


def _fields(fields: list[np.ndarray], tiles: int) -> np.ndarray:
    """Fields [N, n] -> bytes [tiles, n, ...]: per tile and block, each field's 16 columns in turn."""
    out = []
    for a in fields:
        a = np.pad(a, ((0, tiles * TILE - a.shape[0]), (0, 0)))
        t = np.ascontiguousarray(a.reshape(tiles, TILE, a.shape[1]).transpose(0, 2, 1))  # [t, n, c]
        out.append(t.view(np.uint8).reshape(tiles, a.shape[1], -1))
    return np.concatenate(out, axis=-1)


def _records(f: Format, u: Unpacked, tiles: int) -> np.ndarray:
    N, K = u.codes.shape
    nb = K // BLOCK
    codes = np.pad(u.codes, ((0, tiles * TILE - N), (0, 0))).reshape(tiles, TILE, nb, 2, 4, 4)  # t c b half g i
    lo, hi = codes[:, :, :, 0], codes[:, :, :, 1]  # [t, c, b, g, i]: k = 4g + i, and 16 + 4g + i
    by_group = lambda a: a.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 256)  # noqa: E731  byte 64g + 4c + i
    by_column = lambda a: a.transpose(0, 2, 1, 3).reshape(tiles, nb, 64)  # noqa: E731  [t, c, b, i]: byte 4c + i
    if f.bits == 8:
        parts = [by_group(lo), by_group(hi)]
    else:
        parts = [by_group((lo & 15) | ((hi & 15) << 4))]
        g = np.arange(4, dtype=np.uint8)[:, None]  # broadcast over i
        if f.bits == 5:
            plane = ((((lo >> 4) & 1) << g) | (((hi >> 4) & 1) << (g + 4))).sum(3, dtype=np.uint8)
            parts.append(by_column(plane))
        elif f.bits == 6:
            parts += [by_column((((h >> 4) & 3) << (2 * g)).sum(3, dtype=np.uint8)) for h in (lo, hi)]
    return np.concatenate(parts + [_fields(u.block, tiles)], axis=-1)


def pack(name: str, u: Unpacked) -> PackedWeight:
    """Unpacked codes and parameters in the kernel's layout."""
    f = FORMATS[name]
    N, K = u.codes.shape
    if K % f.k_step:
        raise ValueError(f"{name} needs K to be a multiple of {f.k_step}, got {K}")
    tiles = -(-N // TILE)
    records = np.empty((tiles, K // BLOCK, f.record), dtype=np.uint8)
    sup = np.empty((tiles, K // f.k_step, f.super), dtype=np.uint8) if f.super else None
    for r0 in range(0, N, ROWS_PER_CHUNK):
        part = u.rows(r0, r0 + ROWS_PER_CHUNK)
        t0, n = r0 // TILE, -(-part.codes.shape[0] // TILE)
        records[t0:t0 + n] = _records(f, part, n)
        if sup is not None:
            sup[t0:t0 + n] = _fields(part.sup, n)
    return PackedWeight(name, N, K, records, sup)


def pack_float(w: np.ndarray) -> PackedWeight:
    """Float weights [N, K] (float16: F16, float32: F32) in the kernel's layout: per tile and block of 32 along K,
    value (column c, k) at 16k + c."""
    name = "F16" if w.dtype == np.float16 else "F32"
    w = w.astype(np.float16 if name == "F16" else np.float32, copy=False)
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"{name} weights need K to be a multiple of {BLOCK}, got {K}")
    tiles = -(-N // TILE)
    t = np.pad(w, ((0, tiles * TILE - N), (0, 0))).reshape(tiles, TILE, K // BLOCK, BLOCK).transpose(0, 2, 3, 1)
    return PackedWeight(name, N, K, np.ascontiguousarray(t).view(np.uint8).reshape(tiles, K // BLOCK, -1), None)


def pack_gguf(name: str, raw: np.ndarray, K: int) -> PackedWeight:
    """GGUF rows [N, K/qk * nbytes] of format `name`, in the kernel's layout, a chunk of rows at a time."""
    if name in FLOAT_FORMATS:
        return pack_float(np.ascontiguousarray(raw).view(np.float16 if name == "F16" else np.float32).reshape(-1, K))
    N = raw.shape[0]
    parts = [pack(name, unpack(name, raw[r0:r0 + ROWS_PER_CHUNK], K)) for r0 in range(0, N, ROWS_PER_CHUNK)]
    if len(parts) == 1:
        return parts[0]
    return PackedWeight(name, N, K, np.concatenate([p.records for p in parts]),
                        None if parts[0].super is None else np.concatenate([p.super for p in parts]))


def from_q4_1(qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> PackedWeight:
    """Q4_1 blocks (q [N, K] in 0..15, d and m [N, K/32] float16), e.g. a float weight rounded onto them."""
    return pack("Q4_1", Unpacked(qs.astype(np.uint8), [d.astype(np.float16), m.astype(np.float16)], []))
