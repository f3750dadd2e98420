#!/usr/bin/env python3
"""A model of the PTX ISA's documented fragment layouts (ldmatrix .x4 with and without .trans, mma.m16n8k16
row.col with fp32 accumulators), driven by the index formulas of include/memkit/attention/detail/mma_forward.hpp
(a_fragment and b_fragment, which the forward and both backward passes use; copied here as (row, col) pairs: keep
them in step), checked against NumPy products.

It checks the kernels' indexing against the documentation as read, not the hardware (tests/cuda/attention_test.cu
does that on a GPU). The formulas: Q / dO A fragments, K (and V in the dq pass) as non-transposed B fragments,
V (and K in the dq pass) through ldmatrix.trans, and the m16n8 accumulators of two 8-key blocks reused as the A
fragment of one 16-key step, at every head_dim the kernels run (mma_head_dims: 64, 96, 128, 256; at 256 the
backward's 64-row tiles in halves). It also checks that the shared tiles' row stride (head_dim + 8 elements) keeps
every ldmatrix phase free of bank conflicts. Run by hand (needs NumPy): python3 tests/sass/mma_fragment_model.py
"""
import sys

import numpy as np
rng = np.random.default_rng(0)

def ldmatrix_x4(smem, addr_of_lane, trans):
    # addr_of_lane(l) -> (row, col) of the row start given by lane l; matrix m = rows of lanes 8m..8m+7.
    regs = [[None] * 4 for _ in range(32)]
    for m in range(4):
        mat = np.array([smem[r, c:c + 8] for r, c in (addr_of_lane(8 * m + i) for i in range(8))])
        if trans: mat = mat.T
        for l in range(32):
            regs[l][m] = (mat[l // 4, 2 * (l % 4)], mat[l // 4, 2 * (l % 4) + 1])
    return regs

def mma(c, a, b0, b1):
    # c[l] 4 floats, a[l] 4 regs (pairs), b0[l], b1[l] pairs: build matrices, multiply, scatter.
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        for i, (r, cc) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[r, cc], A[r, cc + 1] = a[l][i]
        B[2 * t, g], B[2 * t + 1, g] = b0[l]
        B[2 * t + 8, g], B[2 * t + 9, g] = b1[l]
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = c[l]
    C = C + A @ B
    for l in range(32):
        g, t = l // 4, l % 4
        c[l] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]

def a_fragment(l, s):
    # a_fragment<LD>(lane, 0, s): {row * LD, s * 16, (lane / 16) * 8}
    return (l % 16, s * 16 + (l // 16) * 8)

def b_fragment(transposed, l, s, n):
    # b_fragment<transposed, LD>(lane, s, n)
    if transposed:
        return (s * 16 + ((l // 8) % 2) * 8 + l % 8, n * 8 + (l // 16) * 8)
    return (n * 8 + (l // 16) * 8 + l % 8, s * 16 + ((l // 8) % 2) * 8)

def bank_conflicts(LD, addr_of_lane):
    # ldmatrix reads each 8x8 matrix (8 rows of 16 bytes) in one shared-memory phase: the 8 row addresses must fall
    # in 8 different 16-byte groups of the 128-byte bank window, or the phase serializes. Returns the worst phase's
    # conflict degree (1: none). addr_of_lane gives (row, col) in elements of a [rows][LD] 16-bit tile.
    worst = 1
    for m in range(4):
        groups = [((r * LD + c) * 2 // 16) % 8 for r, c in (addr_of_lane(8 * m + i) for i in range(8))]
        worst = max(worst, max(groups.count(x) for x in set(groups)))
    return worst

PAD = 8  # mma_tiles::pad
for D in (64, 96, 128, 256):
    # Every ldmatrix pattern of the kernels (A rows, B plain and .trans) at every k-step and column block: no
    # conflicts with the padded stride D + 8, conflicts without it (so the check can tell).
    for LD, expect_free in ((D + PAD, True), (D, False)):
        worst = max([bank_conflicts(LD, lambda l, s=s: a_fragment(l, s)) for s in range(D // 16)] +
                    [bank_conflicts(LD, lambda l, s=s, n=n: b_fragment(False, l, s, n))  # K: n over keys
                     for s in range(D // 16) for n in range(0, 64 // 8, 2)] +
                    [bank_conflicts(LD, lambda l, s=s, n=n: b_fragment(True, l, s, n))  # V: s over keys
                     for s in range(64 // 16) for n in range(0, D // 8, 2)])
        print("D", D, "row stride", LD, "elements: worst ldmatrix phase conflict", worst)
        assert (worst == 1) == expect_free, "shared padding"
for D in (64, 96, 128, 256):
    # Above head_dim 128 the backward passes take the other side's 64-row tile in halves (tile + h * LD in the
    # kernels: the sub-matrix of rows h..h+31), each half a full S step and a full P V-like step.
    N, dk, on = 64, D // 16, D // 8
    KS = N if D <= 128 else N // 2
    sn = KS // 8
    Q = rng.standard_normal((16, D)); K = rng.standard_normal((N, D)); V = rng.standard_normal((N, D))
    qa = [ldmatrix_x4(Q, lambda l, s=s: a_fragment(l, s), False) for s in range(dk)]
    Sgot = np.zeros((16, N))
    o = [[[0.0] * 4 for _ in range(32)] for _ in range(on)]
    for h in range(0, N, KS):
        Kh, Vh = K[h:h + KS], V[h:h + KS]
        sc = [[[0.0] * 4 for _ in range(32)] for _ in range(sn)]
        for s in range(dk):
            for n in range(0, sn, 2):
                kb = ldmatrix_x4(Kh, lambda l: b_fragment(False, l, s, n), False)
                mma(sc[n], [qa[s][l] for l in range(32)], [kb[l][0] for l in range(32)], [kb[l][1] for l in range(32)])
                mma(sc[n + 1], [qa[s][l] for l in range(32)], [kb[l][2] for l in range(32)], [kb[l][3] for l in range(32)])
        for n in range(sn):
            for l in range(32):
                g, t = l // 4, l % 4
                Sgot[g, h + n * 8 + 2 * t: h + n * 8 + 2 * t + 2] = sc[n][l][0:2]
                Sgot[g + 8, h + n * 8 + 2 * t: h + n * 8 + 2 * t + 2] = sc[n][l][2:4]
        # P from the accumulators (kernel: pa[n/2][(n%2)*2 + 0] = (c0, c1), pa[n/2][(n%2)*2 + 1] = (c2, c3))
        pa = [[[None] * 4 for _ in range(32)] for _ in range(sn // 2)]
        for n in range(sn):
            for l in range(32):
                pa[n // 2][l][(n % 2) * 2 + 0] = tuple(sc[n][l][0:2])
                pa[n // 2][l][(n % 2) * 2 + 1] = tuple(sc[n][l][2:4])
        for s in range(sn // 2):
            for n in range(0, on, 2):
                vb = ldmatrix_x4(Vh, lambda l: b_fragment(True, l, s, n), True)
                mma(o[n], pa[s], [vb[l][0] for l in range(32)], [vb[l][1] for l in range(32)])
                mma(o[n + 1], pa[s], [vb[l][2] for l in range(32)], [vb[l][3] for l in range(32)])
    Sref = Q @ K.T
    print("D", D, "S = Q K^T max err", np.abs(Sgot - Sref).max())
    P = Sgot
    Oref = P @ V
    Ogot = np.zeros((16, D))
    for n in range(on):
        for l in range(32):
            g, t = l // 4, l % 4
            Ogot[g, n * 8 + 2 * t: n * 8 + 2 * t + 2] = o[n][l][0:2]
            Ogot[g + 8, n * 8 + 2 * t: n * 8 + 2 * t + 2] = o[n][l][2:4]
    print("D", D, "O = P V max err", np.abs(Ogot - Oref).max() / np.abs(Oref).max())
    assert np.abs(Sgot - Sref).max() < 1e-9 and np.abs(Ogot - Oref).max() / np.abs(Oref).max() < 1e-12, "layout mismatch"
print("mma fragment model: the kernels' index formulas give Q K^T and P V; the padded tiles are conflict-free")
