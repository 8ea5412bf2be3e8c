"""Running `bench throughput`'s modes: one engine's run at one C as a closed loop of
requests (`ClosedLoop`), recorded with its steps (`RunRecorder`), and the runs of several
modes alternated (`run_interleaved`) so that the machine's drift hits every mode alike.

Why runs alternate by slices of time: with a closed loop a run at C is one wave, so
alternating by waves ran each mode's whole run (6-10 s at one request on SmolLM2) in one
block. Memory bandwidth here moves by tens of percent within seconds, and two identical
plain engines then read 0.85-1.26x each other (the A/A control of the 2026-12-06 sweeps),
wider than the differences the policy benchmark has to tell apart. Alternating every
`SLICE_SECONDS` of stepping spreads each phase of the machine over every mode.
"""

from __future__ import annotations

import time

from specmoe.bench import throughput_ep

INTERLEAVE = ("slice", "wave", "run")  # how the modes alternate within a repetition
ARRIVALS = ("waves", "closed")  # how a run at C < num_requests submits its requests
# stepping per mode before the next mode's turn ("slice"): on tiny-moe at 16 requests
# (a run of ~1.5 s) two identical plain engines read 0.94-1.16x each other over turns of
# 0.5 s (three turns a run, seconds apart among nine modes), 0.98-1.02x over turns of 0.1 s
SLICE_SECONDS = 0.1


def output_len_range(max_tokens: int, ratio: float) -> tuple[int, int]:
    """The least and most tokens a request generates with output lengths spread by
    `ratio` around `max_tokens` (`ThroughputBenchConfig.max_tokens_range_ratio`)."""
    spread = round(max_tokens * ratio)
    return max(1, max_tokens - spread), max_tokens + spread


def waves_for(num_prompts: int, concurrency: int, num_requests: int,
              arrival: str = "waves") -> list[list[int]]:
    """Prompt indices of a run: max(num_requests, concurrency) requests (prompts cycled
    over num_prompts) in waves of `concurrency` submitted at once (the last may be short),
    or with `arrival="closed"` all of them as one wave (run `concurrency` at a time)."""
    indices = [i % num_prompts for i in range(max(num_requests, concurrency))]
    if arrival == "closed":
        return [indices]
    return [indices[i:i + concurrency] for i in range(0, len(indices), concurrency)]


class ClosedLoop:
    """The requests of `indices` (greedy, EOS ignored, `max_tokens` each or a prompt's own
    "max_tokens", `throughput.assign_output_lengths`) on one engine, at most `concurrency`
    in flight, each submitted as soon as a slot frees (all at once where they fit),
    stepped for as long as `advance` is asked to. Between two calls the engine is
    left alone (another mode's engine may run): that pause counts neither in the loop's
    latencies nor in its requests' metrics (their arrival times move on by it), so a row per
    finished request (`rows`, its latency from its own submission) reads as if the loop had
    run alone."""

    def __init__(self, llm, prompts: list[dict], indices: list[int], max_tokens: int,
                 concurrency: int) -> None:
        from specmoe.sampling_params import SamplingParams
        self.llm, self.prompts, self.concurrency = llm, prompts, concurrency
        self.params = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                       for n in {p.get("max_tokens", max_tokens) for p in prompts}}
        self.max_tokens = max_tokens
        self.queue = list(indices)[::-1]
        self.inflight: dict[str, list] = {}  # request id -> [prompt index, submitted at, request]
        self.rows: list[dict] = []
        self._left_at: float | None = None  # when the last `advance` returned

    @property
    def done(self) -> bool:
        return not self.queue and not self.inflight

    def advance(self, seconds: float | None = None) -> None:
        """Step the engine until every request has finished or, with `seconds`, until a step
        ends `seconds` or more after the call began (at least one step runs).

        Raises:
            ValueError: a prompt the engine refuses (as `LLM.generate`); whatever a step
                raises. Every request in flight is aborted first, so no KV cache block is
                left held.
        """
        start = time.perf_counter()
        if self._left_at is not None:
            self._resume(start - self._left_at)
        try:
            while self.queue and len(self.inflight) < self.concurrency:
                self._submit()
            while self.inflight:
                for done in self.llm.engine.step():
                    self._finish(done.request_id)
                if seconds is not None and time.perf_counter() - start >= seconds:
                    break
        except BaseException:
            self.abort()
            raise
        self._left_at = time.perf_counter()

    def abort(self) -> None:
        """Abort the requests in flight and drop those not yet submitted."""
        for _, _, req in self.inflight.values():
            self.llm.engine.abort_request(req.request_id)
        self.inflight.clear()
        self.queue.clear()

    def _submit(self) -> None:
        i = self.queue.pop()
        prompt = self.prompts[i]
        req = self.llm.make_request(prompt["token_ids"],
                                    self.params[prompt.get("max_tokens", self.max_tokens)])
        self.llm.add_request(req)
        self.inflight[req.request_id] = [i, time.perf_counter(), req]

    def _finish(self, request_id: str) -> None:
        i, submitted, req = self.inflight.pop(request_id)
        self.rows.append(_request_row(req, i, time.perf_counter() - submitted))
        if self.queue:
            self._submit()

    def _resume(self, pause: float) -> None:
        for entry in self.inflight.values():
            entry[1] += pause
            entry[2].metrics.arrival_time += pause


def _request_row(req, prompt_index: int, latency: float) -> dict:
    m, num_tokens = req.metrics, len(req.output_token_ids)
    return {"prompt_index": prompt_index, "num_prompt_tokens": len(req.prompt_token_ids),
            "num_tokens": num_tokens, "finish_reason": req.finish_reason,
            "latency_s": latency, "first_token_s": m.first_token_time_s,
            "decode_tokens_per_s": m.decode_tokens_per_s(num_tokens)}


class RunRecorder:
    """One run of one engine at one C: its waves (`plan`) stepped a slice at a time
    (`advance`) or a whole wave at a time (`wave`), so that several engines can alternate;
    `finish` gives what `run_once` returns. The engine's counters and prefix cache are reset
    at the start; its step method is timed inside `advance` only (the target is shared with
    the other modes' engines), and so is the run's wall time."""

    def __init__(self, llm, concurrency: int) -> None:
        self.llm, self.concurrency = llm, concurrency
        core = llm.engine
        core.reset_stats()
        llm.reset_prefix_cache()
        self._prefix = core.scheduler.kv_cache.block_pool.prefix_cache_stats
        self._queried, self._hit = self._prefix.num_query_tokens, self._prefix.num_hit_tokens
        self.steps: list[list] = []
        self.requests: list[dict] = []
        self.wall = 0.0
        self.ep_stats: dict | None = None
        self._loops: list[ClosedLoop] = []

    @property
    def done(self) -> bool:
        """Whether every planned wave has finished."""
        return not self._loops

    def plan(self, prompts: list[dict], waves: list[list[int]], max_tokens: int) -> None:
        """Queue waves of prompt indices, to run one after another (`advance`)."""
        self._loops += [ClosedLoop(self.llm, prompts, w, max_tokens, self.concurrency)
                        for w in waves]

    def advance(self, seconds: float | None = None) -> int:
        """Run the planned waves for about `seconds` of stepping (None: to their end);
        returns how many requests finished.

        Raises:
            what `ClosedLoop.advance` raises; the run's unfinished waves are dropped.
        """
        core = self.llm.engine
        probe = throughput_ep.CommunicationProbe.start(self.llm)
        core.step = _timed_step(core, self.steps)  # instance attribute shadows the method
        start, finished = time.perf_counter(), 0
        try:
            left = seconds
            while self._loops and (left is None or left > 0):
                loop, before = self._loops[0], len(self._loops[0].rows)
                loop.advance(left)
                finished += len(loop.rows) - before
                if loop.done:
                    self.requests += self._loops.pop(0).rows
                if seconds is not None:
                    left = seconds - (time.perf_counter() - start)
        except BaseException:
            self.abort()
            raise
        finally:
            self.wall += time.perf_counter() - start
            del core.step
            if probe is not None:
                self.ep_stats = throughput_ep.merge(self.ep_stats, probe.finish())
        return finished

    def wave(self, prompts: list[dict], indices: list[int], max_tokens: int) -> int:
        """Run one wave (the prompts at `indices`, at most `concurrency` in flight: more
        are submitted as others finish) to its end and add it; returns its requests."""
        self.plan(prompts, [indices], max_tokens)
        return self.advance()

    def abort(self) -> None:
        """Drop the unfinished waves, aborting their requests in flight."""
        for loop in self._loops:
            loop.abort()
        self._loops = []

    def finish(self) -> dict:
        """The run's raw figures (`run_once`)."""
        queried = self._prefix.num_query_tokens - self._queried
        hit_rate = (self._prefix.num_hit_tokens - self._hit) / queried if queried else 0.0
        num_tokens = sum(r["num_tokens"] for r in self.requests)
        run = {"concurrency": self.concurrency,
               "num_waves": -(-len(self.requests) // self.concurrency),
               "wall_seconds": self.wall, "num_output_tokens": num_tokens,
               "tokens_per_s": num_tokens / self.wall, "requests": self.requests,
               "steps": self.steps,
               "engine_stats": self.llm.engine.stats.to_dict(prefix_cache_hit_rate=hit_rate)}
        if self.ep_stats is not None:
            run["expert_parallel"] = self.ep_stats
        return run


def _timed_step(core, steps: list[list]):
    step = core.step

    def timed():
        num_steps, emitted = core.stats.num_steps, core.stats.num_generation_tokens
        t = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - t
        last = core.stats.last_step
        if core.stats.num_steps > num_steps and last is not None:
            steps.append([round(seconds, 5), last.num_scheduled_requests,
                          last.num_scheduled_tokens, last.num_draft_tokens,
                          last.num_preempted, last.num_logits,
                          core.stats.num_generation_tokens - emitted])
        return out
    return timed


def run_once(llm, prompts: list[dict], concurrency: int, max_tokens: int,
             num_requests: int = 1, arrival: str = "waves") -> dict:
    """One run at `concurrency` (see `waves_for`): its waves one after another, timed from
    each wave's submission to its last finish.

    Returns the run's raw figures: wall seconds (the waves' sum), output tokens, tokens/s,
    every request (latency from its submission to its finish, time to first token,
    decode tokens/s), every step (`STEP_FIELDS`), the engine's statistics over the run and
    its prefix-cache hit rate.
    """
    rec = RunRecorder(llm, concurrency)
    rec.plan(prompts, waves_for(len(prompts), concurrency, num_requests, arrival), max_tokens)
    rec.advance()
    return rec.finish()


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n modes (indices) in which every mode follows every other one equally often
    and takes every position equally often: the rows of a Williams design (Williams 1949,
    "Experimental designs balanced for the estimation of residual effects of treatments"),
    n rows for an even n, 2n (the rows and their mirrors) for an odd one. Two modes give
    [0, 1], [1, 0]. Why: a turn leaves the caches, the allocator's free lists and the
    clock to the next mode; with the order only reversed every other turn, a mode in the
    middle always followed the same two neighbours, and the last one the dearest modes."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(j + r) % n for j in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def run_interleaved(engines: dict, modes: list[str], prompts: list[dict], concurrency: int,
                    max_tokens: int, num_requests: int, on_progress=None,
                    arrival: str = "waves", start: int = 0,
                    slice_seconds: float | None = None) -> dict[str, dict]:
    """One run per mode at `concurrency`, alternating: with `slice_seconds`, each mode steps
    its run for that long in turn (a closed loop's one wave included), else the modes take
    turns wave by wave; turn i takes the modes in the order `balanced_orders` gives at
    row `start` + i, so every mode follows every other one equally often. `on_progress(mode,
    n)` is called after each turn with the requests it finished. A mode that raises is
    dropped from the remaining turns and returned as {"error": ...}; the others go on."""
    recs = {m: RunRecorder(engines[m], concurrency) for m in modes}
    errors: dict[str, dict] = {}
    waves = waves_for(len(prompts), concurrency, num_requests, arrival)

    def turn(mode: str, run) -> None:
        try:
            finished = run(recs[mode])
        except Exception as exc:  # noqa: BLE001 - kept in the report
            errors[mode] = {"concurrency": concurrency,
                            "error": f"{type(exc).__name__}: {exc}"}
            return
        if on_progress is not None:
            on_progress(mode, finished)

    rows = balanced_orders(len(modes))

    def order(i: int) -> list[str]:
        return [modes[j] for j in rows[(start + i) % len(rows)] if modes[j] not in errors]
    try:
        if slice_seconds is None:
            for i, wave in enumerate(waves):
                for mode in order(i):
                    turn(mode, lambda r, w=wave: r.wave(prompts, w, max_tokens))
        else:
            for rec in recs.values():
                rec.plan(prompts, waves, max_tokens)
            i = 0
            while turns := [m for m in order(i) if not recs[m].done]:
                for mode in turns:  # only its own turn can finish a mode's run
                    turn(mode, lambda r: r.advance(slice_seconds))
                i += 1
    finally:  # an interrupt must not leave a paused mode's requests holding KV blocks
        for rec in recs.values():
            rec.abort()
    return {m: errors.get(m) or recs[m].finish() for m in modes}
