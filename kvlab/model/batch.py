"""The batched step's input: every scheduled token of every sequence, flattened into one [N] batch.

Ragged: each sequence brings its own number of tokens, at its own positions, which start at its
num_computed_tokens. The engine's model runner builds it (block tables, slot mapping) and calls
`LlamaModel.forward_batch(batch, pool)`, which runs the model's one layer loop over the flat batch with a
PagedAttention (kvlab/model/attention.py): embedding, projections, RoPE and the MLP over all N rows at
once, attention per sequence against its own blocks, new K/V written through the slot mapping first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BatchInput:
    """What the scheduler hands the model for one step (lengths are plain ints)."""

    token_ids: np.ndarray          # [N] every scheduled token, sequence after sequence
    positions: np.ndarray          # [N] each token's absolute position
    query_lens: list[int]          # tokens per sequence (sum = N)
    context_lens: list[int]        # per sequence: positions visible after this step (num_computed + query_len)
    block_tables: list[list[int]]  # per sequence
    slot_mapping: np.ndarray       # [N] where each new K/V row is written
    logits_indices: np.ndarray     # rows of the flat batch whose logits are returned
    key_starts: list[int] | None = None  # per sequence: first visible key position (a cache policy's
                                         # view start, kvlab/engine/kv_bounds.py); None: 0 for every one
    # per layer window with its own KV-cache group (a hybrid model's sliding layers, kvlab/engine/kv_groups.py):
    # that group's block tables and slot mapping; the layers of any other window use the two fields above
    window_tables: dict[int, tuple[list[list[int]], np.ndarray]] | None = None
