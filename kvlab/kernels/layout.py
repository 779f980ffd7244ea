"""The weight tiles' shape: the numbers the layout code (model/qtiles.py) and the kernels that read it
(kernels/qsimd.py, kernels/qdot.py) must agree on, kept in one place so they cannot drift: plain ints, so
the layout code reads them without importing a kernel."""

LANES = 8  # output rows a tile interleaves: one float32 lane each of a 256-bit register
QUAD = 4  # columns one int32 lane of an integer dot product (vpdpbusd, vpmaddubsw + vpmaddwd) sums
BIT_PLANE = 4  # 5-bit codes: a group's planes of nibbles (32 bytes each) before its plane of fifth bits
