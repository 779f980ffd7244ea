"""RoPE tables per layer kind: each position's cos and sign-folded sin, for every rotation a model uses.

Most models rotate every layer the same way ("global": rope_theta with rope_scaling). Gemma 3's sliding
layers rotate with their own base and no scaling ("local"); SmolLM3's NoPE layers do not rotate ("none":
cos 1, sin 0, so the kernels' rotation leaves q and k exactly as they are). The layer loop asks for the
table of each layer's kind (`ModelConfig.layer_rope`), so the kernels never learn that layers differ.

Partial rotary (Phi-3/4: the first `rotary_dim` channels of a head rotate, the rest pass) is made a full
rotation over a reordered head: the model permutes the rows of q_proj and k_proj (`rotary_row_order`) so
the rotated pairs (i, i + r/2) become (i, i + d/2) and the passing channels pair up behind them with
frequency 0. q.k is a sum over channels, so the same order on q and k leaves every score unchanged; v is
not reordered. LongRoPE (Phi-3/4): position p rotates with the short factors while p < the pretraining
length and with the long ones after, times the attention factor; this is transformers' rule for a
prompt within the pretraining length followed by decode steps (it takes the long factors for a whole
forward once any position passes it, so a single forward over a longer prompt rotates its early
positions differently there; kvlab keeps each key's rotation a function of its position alone).
"""

from __future__ import annotations

import numpy as np

from kvlab.config import ModelConfig
from kvlab.model.layers import longrope_inv_freq, rope_inv_freq


def rotary_row_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Channel order of a head that turns rotate-half over its first `rotary_dim` channels into
    rotate-half over all `head_dim` (new channel j holds old channel order[j])."""
    r2, p2 = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = np.concatenate([np.arange(r2), rotary_dim + np.arange(p2)])
    second = np.concatenate([r2 + np.arange(r2), rotary_dim + p2 + np.arange(p2)])
    return np.concatenate([first, second])


class RopeTables:
    """cos and sign-folded sin [N, d] per kind ("global", "local", "none"), grown by doubling."""

    def __init__(self, config: ModelConfig, dtype: np.dtype) -> None:
        self.config, self.dtype = config, np.dtype(dtype)
        self.kinds = sorted({config.layer_rope(i) for i in range(config.num_hidden_layers)})
        self.tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.inv_freq = self._padded(self._frequencies("global")[0])  # what a context shift re-rotates by

    def _frequencies(self, kind: str) -> tuple[np.ndarray, np.ndarray | None, int, float]:
        """(inv_freq, long inv_freq or None, where the long ones start, attention factor) of a kind."""
        c, dim = self.config, self.config.rotary_dim
        scaling = c.rope_scaling
        if kind == "local":
            return rope_inv_freq(dim, c.rope_local_base_freq, None, self.dtype), None, 0, 1.0
        if scaling is not None and scaling.get("rope_type") == "longrope":
            return (longrope_inv_freq(dim, c.rope_theta, scaling["short_factor"], self.dtype),
                    longrope_inv_freq(dim, c.rope_theta, scaling["long_factor"], self.dtype),
                    scaling["original_max_position_embeddings"], scaling["attention_factor"])
        return rope_inv_freq(dim, c.rope_theta, scaling, self.dtype), None, 0, 1.0

    def angles(self, positions: np.ndarray) -> np.ndarray:
        """Each position's rotation angle per channel pair, [N, d/2] in float64 (kind "global"; 0 for the
        passing channels of a partial rotary). Moving a cached key from position p to q rotates it by
        angles(q) - angles(p) (a cache policy's sink rows): under LongRoPE the frequencies change at the
        pretraining length, so that is not (q - p) times one frequency."""
        inv_freq, long_freq, start, _ = self._frequencies("global")
        positions = np.asarray(positions, dtype=np.float64)[:, None]
        angles = positions * self._padded(inv_freq).astype(np.float64)
        if long_freq is not None:
            late = positions[:, 0] >= start
            angles[late] = positions[late] * self._padded(long_freq).astype(np.float64)
        return angles

    def _padded(self, inv_freq: np.ndarray) -> np.ndarray:
        """[d/2] frequencies: the rotated pairs', then 0 for the passing channels (partial rotary)."""
        out = np.zeros(self.config.head_dim // 2, dtype=self.dtype)
        out[:inv_freq.shape[0]] = inv_freq
        return out

    def _build(self, kind: str, size: int) -> tuple[np.ndarray, np.ndarray]:
        d = self.config.head_dim
        if kind == "none":
            sin = np.zeros((size, d), dtype=self.dtype)
            return np.ones((size, d), dtype=self.dtype), sin
        inv_freq, long_freq, start, factor = self._frequencies(kind)
        positions = np.arange(size).astype(self.dtype)[:, None]
        angles = positions * self._padded(inv_freq)
        if long_freq is not None and size > start:
            angles[start:] = positions[start:] * self._padded(long_freq)
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = np.cos(angles), np.sin(angles)
        if factor != 1.0:  # LongRoPE's attention factor, on the rotated channels only
            rotated = np.zeros(d // 2, dtype=bool)
            rotated[:inv_freq.shape[0]] = True
            rotated = np.concatenate([rotated, rotated])
            cos[:, rotated] *= self.dtype.type(factor)
            sin[:, rotated] *= self.dtype.type(factor)
        sin[:, : d // 2] *= -1  # sign-folded for rotate_halves
        return cos, sin

    def __call__(self, positions: np.ndarray | slice, kind: str = "global") -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [N, d] of `positions` (an array, or a slice start:end: views, no copy) for `kind`."""
        end = positions.stop if isinstance(positions, slice) else int(positions.max()) + 1
        cos, _ = self.tables.get(kind, (np.zeros((0, 0)), None))
        if cos.shape[0] < end:
            size = min(max(end, 2 * cos.shape[0], 256), max(end, self.config.max_position_embeddings))
            self.tables[kind] = self._build(kind, size)
        cos, sin = self.tables[kind]
        return cos[positions], sin[positions]
