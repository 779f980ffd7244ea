"""Engine: many requests at once over one paged K/V pool, with a prefix cache across requests.

`add_request` queues a prompt; each `step()` schedules running decodes and prefill chunks (continuous
batching: requests join and leave between steps), runs one batched forward over every scheduled token,
samples, registers newly full blocks in the prefix cache and reports the requests that progressed.
`generate` drives `step()` until its own prompts finish. Every public call validates before it mutates:
a refused request leaves the pool, the queues and the running requests' tokens exactly as they were.
The engine is not thread-safe: drive it from one thread.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence as Seq

import numpy as np

from kvlab import validate
from kvlab.cache.kv_cache import resolve_kv_dtype
from kvlab.cache.paged import BlockPool
from kvlab.cache.quant import QuantFormat
from kvlab.engine.request import Request, RequestOutput, Sequence, Status
from kvlab.engine.sampling import SamplingParams, top_logprobs
from kvlab.engine.scheduler import Scheduler
from kvlab.errors import ConfigError, ContextLengthError, InputError
from kvlab.model.batch import BatchInput
from kvlab.model.llama import LlamaModel, validate_ids
from kvlab.prefix.block_hash import root_key
from kvlab.prefix.prefix_cache import PrefixCache

DEFAULT_MAX_KV_BYTES = 1 << 30  # the default pool (max_num_seqs full-context sequences) is capped at 1 GiB


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class Engine:
    """Continuous batching over a BlockPool: `add_request` / `step` / `abort_request`, or `generate`."""

    def __init__(self, model: LlamaModel, tokenizer: Any = None, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, kv_cache_dtype: object = None,
                 max_model_len: int | None = None) -> None:
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
        config = model.config
        block_size = _positive_int("block_size", block_size)
        max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        max_model_len = _positive_int("max_model_len", max_model_len)
        if max_model_len > config.max_position_embeddings:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context of "
                              f"{config.max_position_embeddings} tokens (max_position_embeddings)")
        if not isinstance(enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        try:
            kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.dtype)
        except InputError as exc:
            raise ConfigError(str(exc)) from None
        scalar_bytes = kv_dtype.itemsize + kv_dtype.scale_bytes_per_scalar() \
            if isinstance(kv_dtype, QuantFormat) else kv_dtype.itemsize  # int8/int4: scales count too
        bytes_per_block = 2 * config.num_hidden_layers * config.num_key_value_heads * block_size \
            * config.head_dim * scalar_bytes
        if num_blocks is not None and kv_cache_memory is not None:
            raise ConfigError("give num_blocks or kv_cache_memory, not both")
        if num_blocks is not None:
            num_blocks = _positive_int("num_blocks", num_blocks)
        elif kv_cache_memory is not None:
            try:
                budget = validate.parse_size(kv_cache_memory, "kv_cache_memory") \
                    if isinstance(kv_cache_memory, str) else _positive_int("kv_cache_memory", kv_cache_memory)
            except InputError as exc:
                raise ConfigError(f"kv_cache_memory: {exc}") from None
            num_blocks = budget // bytes_per_block
            if num_blocks < 1:
                raise ConfigError(f"kv_cache_memory {kv_cache_memory!r} holds no block of "
                                  f"{bytes_per_block} bytes")
        else:
            num_blocks = max(1, min(max_num_seqs * math.ceil(max_model_len / block_size),
                                    DEFAULT_MAX_KV_BYTES // bytes_per_block))

        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kv_cache_dtype = kv_dtype
        self.block_pool = BlockPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                    kv_dtype, block_size, num_blocks, compute_dtype=model.dtype)
        self.prefix_cache = PrefixCache(self.block_pool, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_pool, self.prefix_cache, max_num_seqs, max_num_batched_tokens)
        eos = getattr(tokenizer, "eos_token_ids", None) if tokenizer is not None else None
        self.eos_token_ids = frozenset(int(i) for i in (eos if eos else config.eos_token_ids))
        self._requests: dict[str, Request] = {}     # unfinished
        self._pending: dict[str, RequestOutput] = {}  # to report at the next step (aborts, stashed)
        self._roots: set[bytes] = set()  # chain roots seen: a block whose parent is one starts a chain
        self._ids = itertools.count()
        self._counts = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_computed_tokens": 0,
                        "num_prefill_tokens": 0, "num_steps": 0}

    # --- requests ------------------------------------------------------------------------------------------
    def _make_request(self, request_id: Any, prompt: Any, params: Any, cache_salt: Any) -> Request:
        """Validate everything about one request and build it, touching no engine state."""
        if not isinstance(request_id, str) or not request_id:
            raise InputError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise InputError(f"duplicate request_id {request_id!r}: a request with this id is unfinished")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InputError(f"cache_salt must be a str or None, got {cache_salt!r}")
        ids = self._prompt_ids(prompt)
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer: pass Engine(model, tokenizer) or use stop_token_ids")
        if params.n > self.scheduler.max_num_seqs:
            raise InputError(f"n={params.n} samples can never run at once with max_num_seqs="
                             f"{self.scheduler.max_num_seqs}")
        wanted = params.max_tokens if params.max_tokens is not None else 1
        if len(ids) + wanted > self.max_model_len:
            raise ContextLengthError(
                f"{len(ids)} prompt tokens + {wanted} new tokens exceed max_model_len "
                f"{self.max_model_len}")
        pool = self.block_pool
        if pool.blocks_for(len(ids) + 1) > pool.num_blocks:
            raise InputError(f"a prompt of {len(ids)} tokens needs {pool.blocks_for(len(ids) + 1)} blocks of "
                             f"{pool.block_size} but the pool holds only {pool.num_blocks}: it could never run")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        root = root_key(self.model.fingerprint, self.model.dtype, self.kv_cache_dtype, cache_salt)
        request = Request(request_id, ids, params, root, max_tokens)
        if self.tokenizer is not None:
            for seq in request.seqs:
                seq.decoder = self.tokenizer.stream_decoder(ids)
        return request

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("a text prompt needs a tokenizer: pass Engine(model, tokenizer) or token ids")
            prompt = list(self.tokenizer.encode(prompt))
            if not prompt:
                raise InputError("the prompt is empty: it encodes to no tokens")
        if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
            raise InputError(f"a prompt must be a 1-D list of token ids, got shape {prompt.shape}")
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise InputError(f"a prompt must be a list of token ids or a str, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise InputError("the prompt is empty: every request needs at least one token")
        if any(isinstance(t, bool) for t in prompt):
            raise InputError("token ids must be ints, got a bool")
        return validate_ids([list(prompt)], self.model.config.vocab_size)[0].tolist()

    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request; it joins the running batch at the next step. Raises (engine unchanged) if bad."""
        self._enqueue(self._make_request(request_id, prompt, params, cache_salt))

    def _enqueue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._roots.add(request.root_key)
        self.scheduler.add(request.seqs[0])
        self._counts["num_prompt_tokens"] += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; it comes out of the next step() with finish_reason "abort"."""
        request = self._requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise InputError(f"unknown request_id {request_id!r}: no unfinished request has this id")
        for seq in request.seqs:
            if not seq.finished():
                self._finish(seq, "abort")
        del self._requests[request_id]
        self._pending[request_id] = request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward, sample; the outputs of requests that progressed."""
        progressed: dict[str, Request] = {}
        plan = self.scheduler.schedule()
        for seq in plan.too_long:
            self._finish(seq, "length")
            progressed[seq.request.request_id] = seq.request
        if plan.scheduled:
            self._counts["num_steps"] += 1
            logits, sampled = self._run(plan.scheduled)
            for row, seq in enumerate(sampled):
                self._append_tokens(seq, logits[row])
                progressed[seq.request.request_id] = seq.request
        # Held outputs first (aborts, and others' outputs kept by generate), unless superseded by a newer
        # output of the same request; an aborted id that was reused reports both requests.
        outputs = [out for request_id, out in self._pending.items()
                   if out.finished or request_id not in progressed]
        self._pending.clear()
        for request_id, request in progressed.items():
            outputs.append(request.output())
            if request.finished():
                self._requests.pop(request_id, None)
        return outputs

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[np.ndarray, list[Sequence]]:
        """One batched forward over every scheduled token; logits of the sequences that reach their end."""
        size = self.block_pool.block_size
        ids, positions, slots, logits_rows, sampled = [], [], [], [], []
        row = 0
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            pos = np.arange(start, start + num_new)
            ids.append(seq.token_ids[start:start + num_new])
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // size] * size + pos % size)
            row += num_new
            if start + num_new == seq.num_tokens:
                logits_rows.append(row - 1)
                sampled.append(seq)
            self._counts["num_computed_tokens"] += num_new
            if not (num_new == 1 and seq.num_tokens > seq.request.num_prompt_tokens):
                self._counts["num_prefill_tokens"] += num_new
        batch = BatchInput(
            token_ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
            positions=np.concatenate(positions), query_lens=[n for _, n in scheduled],
            context_lens=[s.num_computed_tokens + n for s, n in scheduled],
            block_tables=[s.block_table for s, _ in scheduled], slot_mapping=np.concatenate(slots),
            logits_indices=np.array(logits_rows, dtype=np.int64))
        logits = self.model.forward_batch(batch, self.block_pool)
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new
            self.prefix_cache.insert(seq.block_table, seq.token_ids, seq.block_keys, seq.request.root_key,
                                     seq.num_computed_tokens)
        return logits, sampled

    def _append_tokens(self, seq: Sequence, logits: np.ndarray) -> None:
        """Sample the next token of `seq` (and fork its siblings at the first one)."""
        request = seq.request
        targets = [seq]
        if not request.forked:  # sample 0 has just finished the prompt: the other samples start here
            for child in request.seqs[1:]:
                self.scheduler.fork(seq, child)
                targets.append(child)
            request.forked = True
        for target in targets:
            token = int(target.sampler(logits[None])[0])
            target.token_ids.append(token)
            self._counts["num_generation_tokens"] += 1
            if target.logprobs is not None:
                target.logprobs.append(top_logprobs(logits, token, request.params.logprobs))
            self._check_stop(target, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        is_stop_id = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if seq.decoder is not None and not is_stop_id:  # a stop token is kept in token_ids, not in text
            before = len(seq.text)
            seq.text += seq.decoder.push(token)
            if params.stop:
                longest = max(len(s) for s in params.stop)
                window = max(0, before - longest + 1)
                found = [i for i in (seq.text.find(s, window) for s in params.stop) if i >= 0]
                if found:
                    seq.text_end = min(found)
                    self._finish(seq, "stop")
                    return
        if is_stop_id:
            self._finish(seq, "stop")
        elif len(seq.token_ids) - seq.request.num_prompt_tokens >= seq.request.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.PENDING_FORK:
            self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq.decoder is not None and seq.text_end is None:
            seq.text += seq.decoder.flush()
        if seq.index == 0 and not seq.request.forked:  # the samples that were to fork from it end too
            for sibling in seq.request.seqs[1:]:
                if not sibling.finished():
                    self._finish(sibling, reason)

    # --- generate ------------------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run `prompts` (a list of token-id lists or strings; one prompt alone is accepted) to completion.

        One RequestOutput per prompt, in order. All prompts are validated before any is queued; requests
        added by others keep running, and their outputs are kept for the caller's next `step()`.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts)
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("prompts must be a non-empty list of prompts (token-id lists or strings)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and len(sampling_params) == len(prompts):
            params_list = list(sampling_params)
        else:
            raise InputError("sampling_params must be one SamplingParams or a list with one per prompt")
        requests = []
        for prompt, params in zip(prompts, params_list):
            request_id = f"generate-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"generate-{next(self._ids)}"
            requests.append(self._make_request(request_id, prompt, params, cache_salt))
        for request in requests:
            self._enqueue(request)
        mine = {r.request_id for r in requests}
        results: dict[str, RequestOutput] = {}
        while len(results) < len(requests):
            for output in self.step():
                if output.request_id in mine:
                    if output.finished:
                        results[output.request_id] = output
                else:
                    self._pending[output.request_id] = output
        return [results[r.request_id] for r in requests]

    # --- inspection ----------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False, nothing done) while any block is in use."""
        if self.block_pool.num_used_blocks:
            return False
        self.block_pool.evict_all()
        return True

    def stats(self) -> dict[str, Any]:
        pool, sched = self.block_pool, self.scheduler
        running = {s.request.request_id for s in sched.running}
        return {
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "num_running": len(running),
            "num_waiting": len(self._requests) - len(running),
            "num_running_seqs": len(sched.running),
            "num_waiting_seqs": len(sched.waiting),
            "num_free_blocks": pool.num_free_blocks,
            "num_blocks": pool.num_blocks,
            **self._counts,
        }

    def cache_state(self) -> dict[str, Any]:
        """A JSON-serialisable picture of the pool: every used or cached block, every unfinished request."""
        pool, sched = self.block_pool, self.scheduler
        size = pool.block_size
        owners: dict[int, tuple[Sequence, int]] = {}  # block -> (a sequence holding it, its index there)
        for seq in sched.running:
            for index, block in enumerate(seq.block_table):
                owners.setdefault(block, (seq, index))
        blocks = []
        stored_tokens = 0
        for block in range(pool.num_blocks):
            info = pool.cached_info(block)
            if info is None and pool.ref_counts[block] == 0:
                continue
            if info is not None:
                tokens = list(info.token_ids)
                parent = None if info.parent is None or info.parent in self._roots else info.parent.hex()[:16]
            else:
                seq, index = owners[block]
                tokens = seq.token_ids[index * size:min((index + 1) * size, seq.num_computed_tokens)]
                parent = None
            stored_tokens += len(tokens)
            blocks.append({"id": block, "ref_count": pool.ref_counts[block],
                           "hash": info.key.hex()[:16] if info is not None else None, "parent": parent,
                           "num_tokens": len(tokens), "token_ids": [int(t) for t in tokens]})
        requests = []
        for request in self._requests.values():
            for seq in request.seqs:
                if seq.status not in (Status.RUNNING, Status.WAITING):
                    continue
                requests.append({
                    "request_id": request.request_id, "index": seq.index, "status": seq.status.value,
                    "num_prompt_tokens": request.num_prompt_tokens,
                    "num_cached_tokens": request.num_cached_tokens,
                    "num_computed_tokens": seq.num_computed_tokens,
                    "num_output_tokens": len(seq.output_token_ids), "block_table": list(seq.block_table)})
        return {"block_size": size, "num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "num_cached_blocks": pool.num_evictable_blocks, "num_used_blocks": pool.num_used_blocks,
                "payload_bytes": stored_tokens * (pool.bytes_per_block // size),
                "capacity_bytes": pool.capacity_bytes, "blocks": blocks, "requests": requests,
                "stats": self.stats()}
