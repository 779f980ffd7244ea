"""The one decode loop and its stop rule (kvlab/generation/loop.py), shared by generate, Session, the CLI,
the prompt cache and the engine."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.generation.loop import DecodeLoop, StopReason, stop_reason


def test_stop_rule_order_stop_id_then_context_then_limit():
    assert stop_reason(7, 5, {7}, 5, room=5) is StopReason.EOS       # a stop id wins, and is kept
    assert stop_reason(1, 5, {7}, 5, room=5) is StopReason.CONTEXT_FULL
    assert stop_reason(1, 5, {7}, 5) is StopReason.MAX_TOKENS
    assert stop_reason(1, 4, {7}, 5, room=9) is None
    assert [r.finish_reason for r in StopReason] == ["stop", "stop", "length", "length", "abort", "abort"]


def counting_loop(max_new, stop, rows=1, room=None, feed_back=False):
    """A fake model whose next token is the number of steps so far (per row: + row)."""
    calls = []

    def step(tokens):
        calls.append(None if tokens is None else tokens[:, 0].tolist())
        logits = np.zeros((rows, 16))
        logits[np.arange(rows), (len(calls) + np.arange(rows)) % 16] = 1.0
        return logits

    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), max_new, stop, pad=0, room=room,
                      feed_back=feed_back)
    return loop, calls


@pytest.mark.parametrize("feed_back", [False, True])
def test_loop_stops_at_a_stop_id_and_says_why(feed_back):
    loop, calls = counting_loop(10, stop=[3], feed_back=feed_back)
    assert [int(t[0]) for t in loop] == [1, 2, 3] and loop.reason is StopReason.EOS
    # without feed-back the last token is never fed; with it every yielded token was
    assert calls == [None, [1], [2]] + ([[3]] if feed_back else [])


def test_loop_reports_the_limit_and_the_context():
    loop, _ = counting_loop(2, stop=[])
    assert len(list(loop)) == 2 and loop.reason is StopReason.MAX_TOKENS
    loop, _ = counting_loop(2, stop=[], room=2)
    assert len(list(loop)) == 2 and loop.reason is StopReason.CONTEXT_FULL
    loop, calls = counting_loop(0, stop=[], room=0)
    assert list(loop) == [] and loop.reason is StopReason.CONTEXT_FULL and calls == []


def test_finished_rows_are_padded_until_every_row_stops():
    loop, _ = counting_loop(10, stop=[2, 3], rows=2)
    steps = [t.tolist() for t in loop]
    assert steps == [[1, 2], [2, 0]] and loop.reason is StopReason.EOS  # row 1 stopped first, then padded
