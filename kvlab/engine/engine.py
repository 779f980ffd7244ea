"""Engine: many requests at once over one paged K/V pool, with a prefix cache across requests.

A hybrid model (layers of different windows: Gemma 2/3) has a pool and a prefix cache per layer type
(`kv_groups`, kvlab/engine/kv_groups.py); `block_pool` and `prefix_cache` are group 0's (full attention).

`add_request` queues a prompt; each `step()` schedules running decodes and prefill chunks (continuous
batching: requests join and leave between steps), runs one batched forward over every scheduled token,
samples, registers newly full blocks in the prefix cache and reports the requests that progressed.
`generate` drives `step()` until its own prompts finish. Every public call validates before it mutates:
a refused request leaves the pool, the queues and the running requests' tokens exactly as they were.
The engine is not thread-safe: drive it from one thread.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

import numpy as np

from kvlab import validate
from kvlab.cache.paged import BlockPool
from kvlab.engine.config import DEFAULT_MAX_KV_BYTES, EngineConfig  # noqa: F401 (DEFAULT_MAX_KV_BYTES: API)
from kvlab.engine.counters import StepCounters
from kvlab.engine.introspection import cache_state, engine_stats
from kvlab.engine.kv_bounds import KVBounds
from kvlab.engine.kv_groups import CacheGroup
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.output_processor import OutputProcessor
from kvlab.engine.request import PromptScore, Request, RequestOutput, Sequence, Status
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.speculative import SpeculativeConfig, Speculator, make_draft
from kvlab.errors import ConfigError, ContextLengthError, InputError
from kvlab.model.llama import LlamaModel
from kvlab.prefix.block_hash import root_key
from kvlab.prefix.prefix_cache import PrefixCache
from kvlab.sampling.sampler import SamplingParams
from kvlab.tier.listener import build_listeners


class Engine:
    """Continuous batching over a BlockPool: `add_request` / `step` / `abort_request`, or `generate`.

    The parts, as nano-vllm's: EngineConfig (checked arguments, pool size), BlockPool (blocks and ref
    counts), PrefixCache (registry, LRU, hit statistics), Scheduler (what runs this step, in which blocks),
    ModelRunner (the batch, the sink writes and the forward), OutputProcessor (sampling, forks,
    detokenization and stop rules after it); introspection.py reads them for stats and the explorer. This
    class is the loop and its public API.
    """

    def __init__(self, model: LlamaModel, tokenizer: Any = None, *, kv_tiers: Seq[Any] | None = None,
                 kv_events_config: Any = None, speculative_config: Any = None, **settings: Any) -> None:
        """`settings`: EngineConfig.create's keywords (block_size, num_blocks, kv_cache_memory, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, kv_cache_dtype, max_model_len, kv_policy: a cache
        policy such as 'sinks:4:60' or 'window:W' run inside the engine, so a sequence holds a bounded
        number of blocks and its prompt may outgrow max_model_len: kvlab/engine/kv_bounds.py). `kv_tiers`: shared
        K/V tier URLs behind the prefix cache, tried in order (redis://, valkey://, file:///dir);
        `kv_events_config`: vLLM's KV events config (kvlab/tier, kvlab/events); `speculative_config`: vLLM's
        (a JSON string or dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m} or {"method": "draft_model", "model": PATH, ...}; kvlab/engine/speculative.py)."""
        spec_config = SpeculativeConfig.parse(speculative_config)  # refused before anything is allocated
        self.config = config = EngineConfig.create(model, **settings)
        c = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len
        self.kv_cache_dtype = config.kv_cache_dtype
        if config.hybrid and (kv_tiers or kv_events_config is not None):
            raise ConfigError("a KV tier and KV events publish one block table per request, but this model's "
                              "layer types keep blocks of their own (KV-cache groups: "
                              f"{', '.join(str(g.window or 'full') for g in config.groups)}): leave kv_tiers "
                              "and kv_events_config unset")
        # one pool, prefix cache and bounds per KV-cache group (kvlab/engine/kv_groups.py); group 0's are
        # block_pool, prefix_cache and bounds
        self.kv_groups: list[CacheGroup] = []
        for index, layout in enumerate(config.groups):
            pool = BlockPool(len(layout.layers), c.num_key_value_heads, c.head_dim, config.kv_cache_dtype,
                             config.block_size, layout.num_blocks, compute_dtype=model.dtype)
            cache = PrefixCache(pool, config.enable_prefix_caching)
            bounds = KVBounds(pool, cache, config.kv_policy if index == 0 else None, layout.window,
                              config.max_num_batched_tokens, group=index)
            self.kv_groups.append(CacheGroup(index, layout.window, layout.layers, pool, cache, bounds))
        self.block_pool, self.prefix_cache = self.kv_groups[0].pool, self.kv_groups[0].prefix_cache
        # the KV tier and vLLM-format KV events listen to the prefix cache (kvlab/tier/listener.py)
        self.cache_listener = build_listeners(
            self.block_pool, root_key(model.fingerprint, model.dtype, config.kv_cache_dtype), kv_tiers,
            kv_events_config, config.enable_prefix_caching)
        if self.cache_listener is not None:
            self.prefix_cache.listeners.append(self.cache_listener)
        self.counters = StepCounters()
        self.kv_policy = config.kv_policy
        self.bounds = self.kv_groups[0].bounds
        self.scheduler = Scheduler(self.block_pool, self.prefix_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.bounds, self.kv_groups)
        self.runner = ModelRunner(model, self.block_pool, self.prefix_cache, self.counters, self.bounds,
                                  self.kv_groups)
        self.output_processor = OutputProcessor(self.scheduler, self.counters)
        self.speculator = None if spec_config is None else Speculator(
            spec_config, self.bounds, config.max_model_len,
            make_draft(spec_config, model, tokenizer) if spec_config.method == "draft_model" else None)
        eos = getattr(tokenizer, "eos_token_ids", None) if tokenizer is not None else None
        self.eos_token_ids = frozenset(int(i) for i in (eos if eos else c.eos_token_ids))
        self._requests: dict[str, Request] = {}     # unfinished
        self._pending: dict[str, RequestOutput] = {}  # to report at the next step (aborts, stashed)
        self._suspended: dict[str, list[Sequence]] = {}  # suspend_request: sequences out of the queues
        self._ids = itertools.count()

    # --- requests ------------------------------------------------------------------------------------------
    def _make_request(self, request_id: Any, prompt: Any, params: Any, cache_salt: Any,
                      scoring: bool = False) -> Request:
        """Validate everything about one request and build it, touching no engine state (`scoring`: the
        prompt alone must fit, Engine.score)."""
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
        wanted = 0 if scoring else params.max_tokens if params.max_tokens is not None else 1
        if self.kv_policy is None and len(ids) + wanted > self.max_model_len:  # a policy keeps its budget
            raise ContextLengthError(
                f"{len(ids)} prompt tokens + {wanted} new tokens exceed max_model_len "
                f"{self.max_model_len}")
        for group in self.kv_groups:
            pool, need = group.pool, group.bounds.max_blocks(len(ids) + 1)
            if need > pool.num_blocks:
                raise InputError(f"a prompt of {len(ids)} tokens needs {need} blocks of "
                                 f"{pool.block_size} but the pool holds only {pool.num_blocks}: it could never run")
        max_tokens = params.max_tokens if params.max_tokens is not None else \
            self.max_model_len if self.kv_policy is not None else self.max_model_len - len(ids)
        root = root_key(self.model.fingerprint, self.model.dtype, self.kv_cache_dtype, cache_salt)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = Request(request_id, ids, params, root, max_tokens, stop_ids, num_kv_groups=len(self.kv_groups))
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
        return validate.token_ids(prompt, "prompt", self.model.config.vocab_size, allow_single=False)

    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request; it joins the running batch at the next step. Raises (engine unchanged) if bad."""
        self._enqueue(self._make_request(request_id, prompt, params, cache_salt))

    def _enqueue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])
        self.counters.num_prompt_tokens += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; it comes out of the next step() with finish_reason "abort"."""
        request = self._requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise InputError(f"unknown request_id {request_id!r}: no unfinished request has this id")
        self._suspended.pop(request_id, None)
        for seq in request.seqs:
            if not seq.finished():
                self.output_processor.finish(seq, "abort")
        del self._requests[request_id]
        self._pending[request_id] = request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def suspend_request(self, request_id: str) -> None:
        """Take an unfinished request out of scheduling: its blocks are released as preemption releases them
        (full blocks stay cached), it keeps its tokens, and it runs again only after `resume_request`. A
        server uses the pair to rerun requests one by one after a step failed, to find the one that fails."""
        request = self._requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise InputError(f"unknown request_id {request_id!r}: no unfinished request has this id")
        for seq in request.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.preempt(seq)
            if seq.status is Status.WAITING and seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
                self._suspended.setdefault(request_id, []).append(seq)

    def resume_request(self, request_id: str) -> None:
        """Queue a suspended request again (first in line, as a preempted one is)."""
        for seq in reversed(self._suspended.pop(request_id, [])):
            if seq.status is Status.WAITING:
                self.scheduler.waiting.appendleft(seq)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward, sample; the outputs of requests that progressed."""
        progressed: dict[str, Request] = {}
        if self.speculator is not None:
            self.speculator.propose_all(list(self.scheduler.running))
        plan = self.scheduler.schedule()
        for seq in plan.too_long:
            self.output_processor.finish(seq, "length")
            progressed[seq.request.request_id] = seq.request
        if plan.scheduled:
            self.counters.num_steps += 1
            logits, sampled = self.runner.run(plan.scheduled)
            plain, rows, row = [], [], 0
            for seq in sampled:  # a speculating sequence has a row per guess after its own
                num_rows = 1 + len(seq.draft)
                if seq.draft:
                    self.speculator.verify(seq, logits[row:row + num_rows], self.output_processor,
                                           self.runner, self.counters)
                else:
                    plain.append(seq)
                    rows.append(row)
                row += num_rows
            if plain:  # every row plain (no guesses): the logits as they are, not a copy
                self.output_processor.process(plain, logits if len(rows) == len(logits) else logits[rows])
            for seq in sampled:
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

    def score(self, prompt: list[int] | str) -> PromptScore:
        """The logits after every prompt token (`.logits`, one row each), as this engine computes them: its
        chunk schedule, cache dtype and cache policy. What `kvlab fidelity` compares with the exact cache.

        The prompt runs as a greedy request for one token, under a cache salt of its own so that no
        prefix-cache entry serves it: every row is computed here. Other requests keep running; their
        outputs are kept for the caller's next `step()`."""
        request_id = f"score-{next(self._ids)}"
        while request_id in self._requests:
            request_id = f"score-{next(self._ids)}"
        request = self._make_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                     cache_salt=request_id, scoring=True)
        request.score = PromptScore()
        self._enqueue(request)
        while not request.finished():
            for output in self.step():
                if output.request_id != request_id:
                    self._pending[output.request_id] = output
        return request.score

    # --- inspection ----------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False, nothing done) while any block is in use."""
        if any(group.pool.num_used_blocks for group in self.kv_groups):
            return False
        for group in self.kv_groups:
            group.prefix_cache.evict_all()
        if self.cache_listener is not None:  # AllBlocksCleared
            self.cache_listener.on_cleared()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drain the KV tier's queued writes (at most `timeout` seconds) and stop the KV event publisher."""
        if self.cache_listener is not None:
            self.cache_listener.close(timeout)

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)

    def cache_state(self) -> dict[str, Any]:
        """A JSON-serialisable picture of the pool: every used or cached block, every unfinished request."""
        return cache_state(self)
