"""The weight tiles' shape: the numbers the layout code (model/qtiles.py) and the kernels that read it
(kernels/qsimd.py, kernels/qdot.py) must agree on, kept in one place so they cannot drift: plain ints, so
the layout code reads them without importing a kernel."""

LANES = 8  # output rows a tile interleaves: one float32 lane each of a 256-bit register
QUAD = 4  # columns one int32 lane of an integer dot product (vpdpbusd, vpmaddubsw + vpmaddwd) sums
BIT_PLANE = 4  # 5-bit codes: a group's planes of nibbles (32 bytes each) before its plane of fifth bits
# 6-bit codes (Q6_K, groups of 16): a group's planes of nibbles (32 bytes each) before its plane of crumbs (the
# two high bits of the four codes in the same byte of each nibble plane's low and high halves). They travel as
# int8 arrays [T, G, 3, 32] (5-bit ones as uint8 [T, G, 5, 32]): the dtype is how a kernel tells them apart
CRUMB_PLANE = 2
# A K type's small signed codes (Q6_K's -32..31, Q3_K's -4..3: int8 codes beside factored int8 scales) go into
# the integer kernels as code + SMALL_BIAS, unsigned (kernels/qdot.py): on AVX2 without VNNI their pair sums
# (at most 2 * 63 * 127) stay in 16 bits for two 32-byte loads, so a group is at most SMALL_GROUP_MAX columns
# (every such type's is 16).
SMALL_BIAS = 32
SMALL_GROUP_MAX = 16
