"""The offline Python API, in the style of vLLM: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import random
from collections.abc import Callable, Sequence

import torch

from specmoe.config import (EngineConfig, ExpertParallelConfig, KernelConfig, ModelConfig,
                            SchedulerConfig, SpeculativeConfig)
from specmoe.engine.core import EngineCore
from specmoe.engine.kv_cache_manager import blocks_for_requests
from specmoe.engine.output_processor import OutputProcessor
from specmoe.engine.validation import RequestValidator
from specmoe.layers.moe.placement import CONTIGUOUS, read_placement
from specmoe.layers.quantization import speculation_caveat
from specmoe.loader.model_loader import TokenizerMissing, load_model, resolve_dtype
from specmoe.outputs import RequestOutput
from specmoe.request import Request
from specmoe.sampling_params import SamplingParams
from specmoe.spec_decode.factory import build_policy, build_proposer
from specmoe.spec_decode.proposer import NoProposer
from specmoe.worker.kernel_switches import KernelSwitches
from specmoe.worker.kv_cache import PagedKVCache, kv_bytes_per_token
from specmoe.worker.model_runner import ModelRunner

PromptType = str | list[int]

logger = logging.getLogger(__name__)


class LLM:
    """A target model, an optional proposer, and a tokenizer.

    Args:
        model: HuggingFace model directory, .gguf file, or alias (e.g. "smollm2-135m").
        speculative: None (no speculation), a SpeculativeConfig, or a dict of its fields,
            e.g. {"method": "ngram", "num_speculative_tokens": 4} or
            {"method": "draft", "draft_model": "path", "num_speculative_tokens": 4}.
        dtype: "float32", "bfloat16", "float16" (CUDA), or "auto": bfloat16 on a CPU where
            the native kernels run, float32 elsewhere (`loader.model_loader.resolve_dtype`).
        device: "cpu", "cuda", ... (None: CUDA when available).
        max_model_len: context limit in tokens (None: the model's).
        seed: seeds the per-request generators of requests without their own seed.
        quantization: None, "int8" or "int4" weight-only quantisation of the target, or
            "gguf": a .gguf file's blocks kept at their own types (`ModelConfig`).
        scheduler: a SchedulerConfig or a dict of its fields (continuous batching limits and
            the KV cache size), e.g. {"max_num_seqs": 16}.
        kv_cache_dtype: None (the scheduler's, default "auto"), or "auto", "bfloat16",
            "float32", "int8": the target's KV cache (`SchedulerConfig.kv_cache_dtype`).
        moe_backend: how a MoE target's routed experts run ("auto", "fused",
            "grouped", "grouped_mm", "reference"; see `ModelConfig.moe_backend`).
        expert_parallel_size: N > 1 shards a MoE target's experts over N processes
            (`worker.expert_parallel`; each process one torch thread and its share of the
            experts): started here on this machine, or, in a process torchrun started, the
            N ranks torchrun started on one or more machines (ranks > 0 serve as workers
            and exit from this call when rank 0 stops); call `shutdown()` to stop them.
        expert_parallel_dispatch: how the ranks exchange tokens under expert parallelism:
            "replicated" (one all_reduce per MoE layer) or "all_to_all" (each rank
            dispatches its slice of the batch's tokens; `ExpertParallelConfig`).
        expert_placement: "contiguous" or the path of a placement file written by
            `specmoe expert-placement` (experts placed from measured load).
        expert_parallel_timeout_s: seconds a collective waits for the other ranks: a rank
            that died or hangs makes the next generate raise `RankFailure` after at most
            this long (then call `shutdown()`).
        kernels: a KernelConfig or a dict of its fields (native-kernel behaviours this
            engine loads and runs with, e.g. {"fused_layers": False}; None, or a field
            left None: the process-wide setting).

    Raises:
        FileNotFoundError, ValueError: bad path, unsupported model, bad option, a draft
            model whose vocabulary differs from the target's, a bad placement file
            (`layers.moe.placement.read_placement`).
    """

    def __init__(self, model: str, speculative: SpeculativeConfig | dict | None = None,
                 dtype: str = "float32", device: str | None = None,
                 max_model_len: int | None = None, seed: int = 0,
                 quantization: str | None = None,
                 scheduler: SchedulerConfig | dict | None = None,
                 moe_backend: str = "auto", expert_parallel_size: int = 1,
                 expert_parallel_dispatch: str = "replicated",
                 expert_placement: str = "contiguous",
                 expert_parallel_timeout_s: float = 60.0,
                 kernels: KernelConfig | dict | None = None,
                 kv_cache_dtype: str | None = None) -> None:
        if isinstance(speculative, dict):
            speculative = SpeculativeConfig(**speculative)
        if isinstance(scheduler, dict):
            scheduler = SchedulerConfig(**scheduler)
        if kv_cache_dtype is not None:
            scheduler = dataclasses.replace(scheduler or SchedulerConfig(),
                                            kv_cache_dtype=kv_cache_dtype)
        if isinstance(kernels, dict):
            kernels = KernelConfig(**kernels)
        ep = ExpertParallelConfig(expert_parallel_size, expert_parallel_dispatch,
                                  expert_placement, expert_parallel_timeout_s)
        dtype = resolve_dtype(dtype, device)
        self.config = EngineConfig(
            ModelConfig(model, dtype, device, max_model_len, quantization, moe_backend),
            speculative, seed,
            scheduler or SchedulerConfig(), ep, kernels or KernelConfig())
        self._workers = _start_expert_parallel(ep, self.config.model)
        self._loaded_drafts: dict = {}  # shared with engines from `with_speculative`
        with KernelSwitches(self.config.kernels):  # packing follows the kernels' switch
            loaded, self.target = _load_target(self.config.model, ep, self._workers)
        self.tokenizer = _try_tokenizer(loaded)
        eos = set(loaded.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.processor = OutputProcessor(self.tokenizer, eos, loaded.max_model_len)
        self.validator = RequestValidator(self.target.vocab_size, self.target.max_model_len,
                                          self.tokenizer is not None)
        self._attach_proposer(speculative)
        self._rng = random.Random(seed)
        self._ids = itertools.count()

    def with_speculative(self, speculative: SpeculativeConfig | dict | None,
                         num_kv_blocks: int | None = None) -> "LLM":
        """A second engine over the same loaded target and tokenizer with another proposer,
        to compare proposers without loading the target twice. A draft model is loaded
        once per (draft_model, draft_quantization) and shared by every engine derived from
        this one: run them one at a time, not concurrently (each has its own KV caches,
        of `num_kv_blocks` blocks if given, else sized as this engine's configuration says).
        """
        if isinstance(speculative, dict):
            speculative = SpeculativeConfig(**speculative)
        other = copy.copy(self)
        if num_kv_blocks is not None:
            other.config = dataclasses.replace(self.config, scheduler=dataclasses.replace(
                self.config.scheduler, num_kv_blocks=num_kv_blocks))
        other._attach_proposer(speculative)
        return other

    def _attach_proposer(self, speculative: SpeculativeConfig | None) -> None:
        self.config = dataclasses.replace(self.config, speculative=speculative)
        caveat = (speculation_caveat(self.target.model)
                  if speculative is not None and self.config.model.quantization else None)
        if caveat is not None:
            logger.warning(
                "speculative decoding on a target quantised to %s: %s, so greedy outputs may "
                "differ from plain decoding at near-ties (unquantised bfloat16 and float32 "
                "targets give identical tokens)", self.config.model.quantization, caveat)
        sched = self.config.scheduler
        num_blocks = _num_kv_blocks(sched, self.target)
        with KernelSwitches(self.config.kernels):
            self.proposer = None if speculative is None else build_proposer(
                speculative, self.target, self.tokenizer, self.config.model, num_blocks,
                sched.block_size, self._loaded_drafts, sched.kv_cache_dtype)
        adaptive = speculative is not None and speculative.policy == "adaptive"
        self.validator = dataclasses.replace(self.validator, max_speculative_tokens=(
            speculative.num_speculative_tokens if adaptive else None))
        self.engine = EngineCore(self.target, self.proposer or NoProposer(), self.processor,
                                 sched, num_blocks,
                                 build_policy(speculative, self.target, self.proposer),
                                 self.config.kernels)

    def shutdown(self) -> None:
        """Stop the expert-parallel worker processes (no-op in one process); a worker that
        died or cannot be told to stop is killed (at once once a collective has failed,
        else after the group's timeout)."""
        if self._workers:
            from specmoe.worker.ep_launch import abort
            try:
                self.target.shutdown()
            except Exception:  # noqa: BLE001 - a dead rank: stop the others regardless
                logger.warning("could not tell the expert-parallel workers to stop",
                               exc_info=True)
            failed = self.target.failure is not None
            abort(self._workers, 0.0 if failed else self.config.expert_parallel.timeout_s)
            self._workers = []

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None
                 ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, or a list of token ids).

        Args:
            sampling_params: one for all prompts, or one per prompt (default:
                SamplingParams()).
            on_finish: called with each output as it finishes (e.g. to drive a progress bar).
        Raises:
            ValueError: a params list of the wrong length, or a prompt or parameters the
                model cannot serve (`engine.validation.RequestValidator`: an empty prompt,
                token ids outside the vocabulary, a prompt that leaves no room in the
                context, stop strings without a tokenizer, ...).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        requests = [self._make_request(p, sp) for p, sp in zip(prompt_list, params_list)]
        outputs: dict[str, RequestOutput] = {}
        try:
            for req in requests:
                self.add_request(req)
            while self.engine.has_unfinished_requests:
                for req in self.engine.step():
                    outputs[req.request_id] = _to_output(req)
                    if on_finish is not None:
                        on_finish(outputs[req.request_id])
        finally:  # an error or interrupt must not leave requests holding KV cache blocks
            for req in requests:
                self.engine.abort_request(req.request_id)
        return [outputs[req.request_id] for req in requests]

    def add_request(self, req: Request) -> None:
        """Queue a request built by `make_request` in the engine (see `step`).

        Raises:
            ValueError: a duplicate id, or a request that cannot fit in the KV cache.
        """
        self.engine.add_request(req, self._generator_for(req.params))

    def kv_cache_summary(self) -> str:
        """One line on the target's KV cache: its dtype, bytes per token over all layers, the
        tokens it holds, and the longest context that `kv_cache_memory_bytes` would hold."""
        sched, cache, arch = self.config.scheduler, self.engine.kv_cache, self.target.arch
        per_token = kv_bytes_per_token(arch, cache.dtype)
        tokens = cache.num_blocks * cache.block_size
        at_memory = sched.kv_cache_memory_bytes // per_token
        longest = self.target.max_model_len
        return (f"KV cache: {sched.kv_cache_dtype} ({str(cache.dtype).removeprefix('torch.')}),"
                f" {per_token} bytes per token over {arch.num_hidden_layers} layers; "
                f"{cache.num_blocks} blocks of {cache.block_size} = {tokens} tokens in "
                f"{cache.num_bytes / 2**30:.2f} GiB; {sched.kv_cache_memory_bytes / 2**30:.2f} "
                f"GiB holds {at_memory} tokens (max context {min(at_memory, longest)} of the "
                f"model's {longest})")

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (as vLLM's `LLM.reset_prefix_cache`), so the next
        requests compute their prompts in full. Benchmarks call it so every run starts alike:
        a prefix hit skips prefill time, and in bf16 it also changes which matmul computes
        the prompt's last tokens, so greedy outputs may differ in the last bits from a miss.
        Returns the number of cache entries dropped."""
        return self.engine.scheduler.kv_cache.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """Run one engine step over every queued request; returns those that finished."""
        return [_to_output(req) for req in self.engine.step()]

    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and tokenize a prompt into a Request (for `add_request`).

        Raises:
            ValueError: as `generate`.
        """
        req = self._make_request(prompt, params or SamplingParams())
        if request_id is not None:
            req.request_id = request_id
        return req

    def chat_prompt(self, messages: list[dict]) -> str:
        """Apply the tokenizer's chat template (with the assistant turn opened).

        Raises:
            ValueError: when the model has no tokenizer or chat template.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.config.model.model} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)

    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return list(sp)

    def _make_request(self, prompt: PromptType, params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            # verbose=False: the tokenizer's model_max_length warning is not the limit;
            # `check_prompt` holds prompts to max_model_len with its own error
            ids = self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        else:
            ids, prompt = list(prompt), None
        self.validator.check_prompt(ids)
        self.validator.check_params(params)
        return Request(str(next(self._ids)), prompt, ids, params)

    def _generator_for(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return torch.Generator(self.target.device).manual_seed(seed)


def _load_target(model_config, ep: ExpertParallelConfig, workers: list):
    """The loaded target and its runner (with expert-parallel workers: rank 0's share,
    `worker.ep_launch.load_rank_zero`)."""
    if not workers:
        loaded = load_model(model_config)
        return loaded, ModelRunner(loaded)
    from specmoe.worker.ep_launch import load_rank_zero
    return load_rank_zero(model_config, ep, workers)


def _start_expert_parallel(ep: ExpertParallelConfig, model_config) -> list:
    """Worker processes of ranks 1..size-1 (`worker.ep_launch.start_group`); [] for size 1.
    A placement file is read first, so a bad one fails before any process starts.

    Raises:
        ValueError, FileNotFoundError: a bad placement file (`read_placement`).
    """
    if ep.placement != CONTIGUOUS:
        read_placement(ep.placement, ep.size)
    if ep.size == 1:
        return []
    from specmoe.worker.ep_launch import start_group
    return start_group(model_config, ep)


def _num_kv_blocks(cfg: SchedulerConfig, target: ModelRunner) -> int:
    """The configured block count, or as many blocks as `kv_cache_memory_bytes` holds, capped
    at what max_num_seqs requests of max_model_len tokens need (`blocks_for_requests`)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = PagedKVCache.bytes_per_block(target.arch, cfg.block_size,
                                             target.kv_dtype(cfg.kv_cache_dtype))
    by_memory = cfg.kv_cache_memory_bytes // per_block
    needed = blocks_for_requests(cfg.max_num_seqs, target.max_model_len, cfg.block_size)
    return max(1, min(by_memory, needed))


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _try_tokenizer(loaded):
    """The target's tokenizer, None when it has none (a tokenizer that fails to load
    raises)."""
    try:
        return loaded.load_tokenizer()
    except TokenizerMissing:
        return None


def _to_output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        text=req.text, token_ids=list(req.output_token_ids),
        logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
        finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        spec_stats=req.spec_stats, metrics=req.metrics, error=req.error)
