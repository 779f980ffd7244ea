"""Engine outputs rendered as OpenAI response bodies and server-sent-event chunks.

The engine reports cumulative outputs (all tokens so far, the text so far with stop strings cut). Streams
send differences, and only text that can no longer change: while a request runs, a trailing incomplete
character (U+FFFD) and the last `len(longest stop string) - 1` characters are held back, because the next
token may complete a stop string that the engine then cuts from the text (vLLM holds back the same way).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def token_string(tokenizer: Any, token_id: int) -> str:
    """One token's text with special tokens kept (logprobs name every token, EOS included)."""
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:  # tokenizers without the flag (the byte tokenizer)
        return tokenizer.decode([int(token_id)])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: Sequence[Any]) -> dict[str, Any]:
    """Usage over the engine requests behind one HTTP request (one per prompt)."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs),
                 sum(int(o.num_cached_tokens) for o in outputs))


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(((int(t), float(lp)) for t, lp in entry.items()), key=lambda kv: -kv[1])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]],
                        num: int, offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        text = token_string(tokenizer, token_id)
        tokens.append(text)
        token_lps.append(float(entry.get(token_id, float("-inf"))))
        tops.append({token_string(tokenizer, t): lp for t, lp in _ranked(entry)[:max(num, 1)]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]],
                  num: int) -> dict[str, Any]:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
    def item(token_id: int, lp: float) -> dict[str, Any]:
        text = token_string(tokenizer, token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        top = [item(t, lp) for t, lp in _ranked(entry)[:num]]
        content.append({**item(token_id, float(entry.get(token_id, float("-inf")))), "top_logprobs": top})
    return {"content": content}


@dataclass
class ChoiceProgress:
    """How much of one choice a stream has sent."""

    hold_back: int = 0
    sent_chars: int = 0
    sent_tokens: int = 0
    started: bool = False
    finished: bool = False

    def advance(self, text: str, num_tokens: int, finished: bool) -> tuple[str, int, int]:
        """The text delta to send now, and the range of new tokens [start, end)."""
        if finished:
            stable = text
        else:
            stable = text.rstrip("\ufffd")
            stable = stable[:max(len(stable) - self.hold_back, 0)]
        delta = stable[self.sent_chars:] if len(stable) > self.sent_chars else ""
        self.sent_chars += len(delta)
        start, self.sent_tokens = self.sent_tokens, num_tokens
        self.finished = finished
        return delta, start, num_tokens


@dataclass
class StreamRenderer:
    """Turns cumulative engine outputs into OpenAI chunks for one streaming HTTP request."""

    kind: str                       # "completion" or "chat"
    request_id: str
    model: str
    n: int
    tokenizer: Any
    num_logprobs: int | None
    include_usage: bool
    hold_back: int
    created: int = field(default_factory=lambda: int(time.time()))
    progress: dict[int, ChoiceProgress] = field(default_factory=dict)
    latest: dict[int, Any] = field(default_factory=dict)

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, update: dict[int, Any]) -> list[str]:
        """SSE lines for one batch of updates (prompt index -> cumulative RequestOutput)."""
        out = []
        self.latest.update(update)
        for prompt_index, output in sorted(update.items()):
            for completion in output.outputs:
                index = prompt_index * self.n + completion.index
                progress = self.progress.setdefault(index, ChoiceProgress(self.hold_back))
                if progress.finished:
                    continue
                if self.kind == "chat" and not progress.started:
                    out.append(sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}])))
                progress.started = True
                text = completion.text or ""
                finish = completion.finish_reason
                offset = progress.sent_chars
                delta, start, end = progress.advance(text, len(completion.token_ids), finish is not None)
                if not delta and finish is None and not (self.num_logprobs is not None and end > start):
                    continue
                logprobs = None
                if self.num_logprobs is not None and completion.logprobs is not None:
                    ids, lps = completion.token_ids[start:end], completion.logprobs[start:end]
                    logprobs = (completion_logprobs(self.tokenizer, ids, lps, self.num_logprobs, offset)
                                if self.kind == "completion" else
                                chat_logprobs(self.tokenizer, ids, lps, self.num_logprobs))
                if self.kind == "completion":
                    choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
                else:
                    choice = {"index": index, "delta": {"content": delta} if delta else {},
                              "logprobs": logprobs, "finish_reason": finish}
                out.append(sse(self._chunk([choice])))
        return out

    def usage_chunk(self) -> str:
        chunk = self._chunk([])
        chunk["usage"] = usage_of([self.latest[i] for i in sorted(self.latest)])
        return sse(chunk)


def completion_body(request_id: str, model: str, outputs: Sequence[Any], n: int, tokenizer: Any,
                    num_logprobs: int | None) -> dict[str, Any]:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            logprobs = None
            if num_logprobs is not None and completion.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, completion.token_ids, completion.logprobs, num_logprobs)
            choices.append({"index": prompt_index * n + completion.index, "text": completion.text or "",
                            "logprobs": logprobs, "finish_reason": completion.finish_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage_of(outputs)}


def chat_body(request_id: str, model: str, output: Any, tokenizer: Any,
              num_logprobs: int | None) -> dict[str, Any]:
    choices = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None
        if num_logprobs is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(tokenizer, completion.token_ids, completion.logprobs, num_logprobs)
        choices.append({"index": completion.index,
                        "message": {"role": "assistant", "content": completion.text or ""},
                        "logprobs": logprobs, "finish_reason": completion.finish_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_of([output])}
