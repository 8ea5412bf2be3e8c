"""The `specmoe` command line: `generate`, `demo`, `serve`, `bench` (spec, throughput, serve,
moe), `models` (install, list, synth, carve, card), `routing` (analyze), `study`, `advise` and
`expert-placement`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specmoe.entrypoints.args import (add_expert_parallel_mode_args, add_model_args,
                                      add_spec_args, apply_threads, comma_list,
                                      expert_parallel_kwargs, fresh_out_dir, json_dict,
                                      llm_from_args, speculative_from_args)
from specmoe.entrypoints.routing_cli import (add_routing_parser, check_trace_path, cmd_routing,
                                             generate_with_trace)
from specmoe.entrypoints.advise_cli import add_advise_parser
from specmoe.entrypoints.peers_cli import add_peers_parser
from specmoe.entrypoints.study_cli import add_study_parser
from specmoe.entrypoints.models_cli import add_models_parser, cmd_models
from specmoe.entrypoints.placement_cli import add_placement_parser, cmd_expert_placement
from specmoe.utils.progress import StderrProgress, reporting


def build_parser() -> argparse.ArgumentParser:
    from specmoe import __version__
    parser = argparse.ArgumentParser(prog="specmoe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(gen)
    add_spec_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128,
                     help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s: off)")
    gen.add_argument("--top-k", type=int, default=0, help="(default: %(default)s: off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="(default: %(default)s: off)")
    gen.add_argument("--seed", type=int, default=None, help="seeds the sampling (default: "
                     "random)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-stream", dest="stream", action="store_false",
                     help="print the text once it is complete (default: as it is generated)")
    gen.add_argument("--routing-trace", default=None, metavar="PATH",
                     help="record the MoE target's routing to PATH (JSONL, docs/routing-trace.md)")
    demo = sub.add_parser("demo", help="speculative vs plain decoding on real prompts, on a "
                                         "dense and a MoE target")
    add_model_args(demo)
    add_spec_args(demo, default_draft="ngram")
    demo.add_argument("--moe-model", default="tiny-moe",
                      help="MoE target shown beside --model, or 'none' (default: %(default)s)")
    demo.add_argument("--moe-draft", default="tiny-moe-draft",
                      help="draft model of --moe-model (default: %(default)s)")
    demo.add_argument("--num-prompts", type=int, default=5,
                      help="prompts per row (default: %(default)s)")
    demo.add_argument("--max-tokens", type=int, default=128,
                      help="tokens per prompt (default: %(default)s)")
    add_serve_parser(sub)
    add_models_parser(sub)
    add_bench_parser(sub)
    add_routing_parser(sub)
    add_study_parser(sub)
    add_advise_parser(sub)
    add_placement_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    from specmoe.entrypoints.openai.api_server import API_KEY_ENV, ServeConfig
    d = ServeConfig()
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    add_model_args(serve)
    add_spec_args(serve)
    serve.add_argument("--host", default=d.host, help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=int, default=d.port, help="(default: %(default)s)")
    serve.add_argument("--served-model-name", default=None,
                       help="the `model` clients pass (default: the --model alias, or the "
                            "last component of its path)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every route but /health "
                            f"(default: ${API_KEY_ENV} if set, else none)")
    serve.add_argument("--max-waiting", type=int, default=d.max_waiting,
                       help="requests that may wait for a slot before new ones get HTTP 429 "
                            "(default: %(default)s)")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="requests running at once (default: the scheduler's)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per engine step (default: the scheduler's)")
    serve.add_argument("--num-kv-blocks", type=int, default=None,
                       help="target KV cache blocks (default: sized by the engine)")
    serve.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                       help="seconds in-flight requests get to finish after SIGTERM "
                            "(default: %(default)s)")
    serve.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                       help="largest request body in bytes; a larger one gets HTTP 413 before "
                            "it is parsed (default: %(default)s, 4 MiB)")
    serve.add_argument("--log-level", default=d.log_level,
                       choices=["critical", "error", "warning", "info", "debug"])


def cmd_serve(args) -> None:
    import logging

    from specmoe import LLM
    from specmoe.entrypoints.openai.api_server import ServeConfig, resolve_api_key, run_server
    cfg = ServeConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                      api_key=args.api_key, max_waiting=args.max_waiting,
                      drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                      max_request_bytes=args.max_request_bytes)
    resolve_api_key(cfg)  # before the model loads
    if cfg.max_waiting < 1:
        raise ValueError(f"invalid --max-waiting={cfg.max_waiting}: must be >= 1")
    if cfg.max_request_bytes < 1:
        raise ValueError(f"invalid --max-request-bytes={cfg.max_request_bytes}: must be >= 1")
    apply_threads(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    scheduler = {k: v for k, v in {"max_num_seqs": args.max_num_seqs,
                                   "max_num_batched_tokens": args.max_num_batched_tokens,
                                   "num_kv_blocks": args.num_kv_blocks}.items() if v is not None}
    with reporting(StderrProgress()):
        llm = LLM(args.model, speculative=speculative_from_args(args), dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len,
                  quantization=args.quantization, scheduler=scheduler,
                  moe_backend=args.moe_backend, kv_cache_dtype=args.kv_cache_dtype,
                  **expert_parallel_kwargs(args))
    logging.getLogger("specmoe.serve").info("%s", llm.kv_cache_summary())
    try:
        run_server(llm, args.model, cfg)
    finally:
        llm.shutdown()


def add_bench_parser(sub) -> None:
    from specmoe.bench.spec import SpecBenchConfig
    d = SpecBenchConfig()
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                      required=True)
    spec = bench.add_parser("spec", help="speculative decoding on real prompt sets")
    spec.add_argument("--model", "--target", dest="target", default=d.target,
                      help="target model: alias, HF directory or GGUF file (default: "
                           "%(default)s)")
    spec.add_argument("--draft", default=d.draft,
                      help="draft model for the draft proposer (default: %(default)s)")
    spec.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                      help="(default: %(default)s)")
    spec.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"],
                      help="the target's weights in int8/int4 (default: --dtype)")
    spec.add_argument("--draft-quantization", default=d.draft_quantization,
                      choices=["int8", "int4", "gguf", "none"], help="(default: %(default)s)")
    spec.add_argument("--datasets", type=comma_list(), default=",".join(d.datasets),
                      help="comma list of humaneval, mt_bench, gsm8k, spec_bench (default: "
                           "%(default)s)")
    spec.add_argument("--num-prompts", type=int, default=d.num_prompts,
                      help="per data set (per category for Spec-Bench)")
    spec.add_argument("--spec-bench-categories", type=comma_list(),
                      default=",".join(d.spec_bench_categories),
                      help="Spec-Bench categories (default: %(default)s)")
    spec.add_argument("--proposers", type=comma_list(), default=",".join(d.proposers),
                      help="comma list of draft, ngram (default: %(default)s)")
    spec.add_argument("--ks", type=comma_list(int), default=",".join(map(str, d.ks)),
                      help="K values to sweep (default: %(default)s)")
    spec.add_argument("--temperatures", type=comma_list(float),
                      default=",".join(map(str, d.temperatures)),
                      help="(default: %(default)s)")
    spec.add_argument("--max-tokens", type=int, default=d.max_tokens,
                      help="tokens per prompt (default: %(default)s)")
    spec.add_argument("--peers", type=comma_list(), default="",
                      help="comma list of transformers, llama-cpp (llama-cpp-python on the "
                           "GGUF file; install it with `make peers`)")
    spec.add_argument("--out", default="out/bench_spec", help="report directory")
    add_bench_throughput_parser(bench)
    add_bench_serve_parser(bench)
    add_bench_moe_parser(bench)
    add_peers_parser(bench)


def add_bench_throughput_parser(bench) -> None:
    from specmoe.bench.throughput import ThroughputBenchConfig
    d = ThroughputBenchConfig()
    tp = bench.add_parser("throughput", help="tokens/s and latency against concurrency, "
                                             "with and without speculation")
    tp.add_argument("--model", default=d.model,
                    help="target model: path or alias (default: %(default)s)")
    tp.add_argument("--draft", default=d.draft,
                    help="'ngram', a draft model path/alias, or 'none' (plain only)")
    tp.add_argument("--num-speculative-tokens", "-k", type=int, default=d.num_speculative_tokens)
    tp.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                    help="the speculative mode pauses speculation while at least this many "
                         "requests run (default: never)")
    tp.add_argument("--speculative-policy", type=comma_list(), default=[],
                    help="speculative modes by policy, each against plain in one interleaved "
                         "sweep: static:K, table (--speculative-batch-size-table), adaptive "
                         "(K_max -k), adaptive:notrim (no cut of n-gram proposals by match length); "
                         "e.g. static:1,static:2,static:4,static:8,table,adaptive "
                         "(default: one static mode, 'spec')")
    tp.add_argument("--speculative-batch-size-table", type=json_dict, default=None,
                    help="the table policy's ranges, e.g. '{\"1-4\": 4, \"5-16\": 2, "
                         "\"17-4096\": 0}'")
    tp.add_argument("--aa-control", action="store_true",
                    help="also run 'plain2', a second engine without speculation: its "
                         "tokens/s over plain's is the run's noise band (an A/A control)")
    tp.add_argument("--spec-bench-categories", type=comma_list(),
                    default=",".join(d.spec_bench_categories),
                    help="Spec-Bench tasks to draw prompts from (default: %(default)s); "
                         "a mixed workload: --datasets humaneval,spec_bench "
                         "--spec-bench-categories translation")
    tp.add_argument("--interleave", choices=["slice", "wave", "run"], default=d.interleave,
                    help="how the modes alternate at each C: by turns of --slice-seconds "
                         "of stepping (default; the machine's drift hits every mode alike), "
                         "wave by wave, or whole runs")
    tp.add_argument("--max-tokens-range-ratio", type=float, default=d.max_tokens_range_ratio,
                    help="R in [0, 1): each prompt's output length uniform in --max-tokens "
                         "x [1 - R, 1 + R] (as vLLM's --random-range-ratio; default: "
                         "%(default)s, every request --max-tokens)")
    tp.add_argument("--slice-seconds", type=float, default=d.slice_seconds,
                    help="a mode's turn with --interleave slice (default: %(default)s)")
    tp.add_argument("--arrival", choices=["waves", "closed"], default=d.arrival,
                    help="how a run at C < --num-requests submits its requests: keeping "
                         "C in flight, the next as one finishes (default: a closed loop, as "
                         "vLLM's --max-concurrency), or in waves of C")
    tp.add_argument("--expert-parallel-size", type=int, default=1,
                    help="shard a MoE target's experts over this many processes (default: 1)")
    add_expert_parallel_mode_args(tp)
    tp.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    tp.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"])
    tp.add_argument("--draft-quantization", default=None, choices=["int8", "int4", "gguf"])
    tp.add_argument("--concurrency", type=comma_list(int),
                    default=",".join(map(str, d.concurrency)),
                    help="comma list of concurrent requests (default: %(default)s)")
    tp.add_argument("--max-tokens", type=int, default=d.max_tokens,
                    help="tokens per request, EOS ignored (default: %(default)s)")
    tp.add_argument("--reps", type=int, default=d.reps,
                    help="repetitions of the sweep (default: %(default)s)")
    tp.add_argument("--datasets", type=comma_list(), default=",".join(d.datasets))
    tp.add_argument("--num-requests", type=int, default=d.num_requests,
                    help="requests of a run at smaller C, in waves of C, so every C sees "
                         "the same prompts (default: %(default)s)")
    tp.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                    help="token budget of one engine step (default: %(default)s)")
    tp.add_argument("--num-kv-blocks", type=int, default=None,
                    help="target KV cache blocks (default: sized by the engine)")
    tp.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's; on cores shared with "
                         "other jobs, 1 avoids oversubscribed threads)")
    tp.add_argument("--out", default=None,
                    help="report directory (default: out/throughput-<date>-<time>)")


def add_bench_serve_parser(bench) -> None:
    from specmoe.bench.serve import ServeBenchConfig
    d = ServeBenchConfig()
    sv = bench.add_parser("serve", help="HTTP load generator for an OpenAI-compatible server")
    sv.add_argument("--base-url", default=d.base_url, help="API root (default: %(default)s)")
    sv.add_argument("--model", default=None, help="model name (default: the server's first)")
    sv.add_argument("--api-key", default=None, help="bearer token (default: $SPECMOE_API_KEY)")
    sv.add_argument("--endpoint", default=d.endpoint, choices=["chat", "completions"])
    sv.add_argument("--datasets", type=comma_list(), default=",".join(d.datasets),
                    help="prompt sets to cycle through (default: %(default)s)")
    sv.add_argument("--num-requests", type=int, default=d.num_requests,
                    help="requests to send (default: %(default)s)")
    sv.add_argument("--duration", type=float, default=None,
                    help="send for this many seconds instead of --num-requests (soak)")
    sv.add_argument("--request-rate", type=float, default=d.request_rate,
                    help="mean requests/s, Poisson arrivals (default: inf, as fast as "
                         "--concurrency allows)")
    sv.add_argument("--concurrency", type=int, default=d.concurrency,
                    help="requests in flight at most (default: %(default)s)")
    sv.add_argument("--max-tokens", type=int, default=d.max_tokens)
    sv.add_argument("--temperature", type=float, default=d.temperature)
    sv.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (our server, vLLM): every request gives max_tokens")
    sv.add_argument("--slo-ttft", type=float, default=d.slo_ttft_s,
                    help="goodput TTFT limit in s (default: %(default)s)")
    sv.add_argument("--slo-tpot", type=float, default=d.slo_tpot_s,
                    help="goodput TPOT limit in s (default: %(default)s)")
    sv.add_argument("--seed", type=int, default=d.seed)
    sv.add_argument("--out", default=None,
                    help="report directory (default: out/bench-serve-<date>-<time>)")
    add_bench_chaos_args(sv)


def add_bench_chaos_args(sv) -> None:
    from specmoe.bench.chaos import ChaosConfig
    d = ChaosConfig()
    sv.add_argument("--chaos", type=float, default=d.rate, metavar="RATE",
                    help="fraction of requests that are hostile (bad bodies, disconnects, "
                         "cancels), in [0, 1]; the run then checks that no valid request "
                         "failed, no hostile one got a 5xx, the server went idle and memory "
                         "stayed flat, and exits 1 if not (default: 0, off)")
    sv.add_argument("--chaos-grace", type=float, default=d.grace_s,
                    help="seconds the server gets to go idle after the load "
                         "(default: %(default)s)")
    sv.add_argument("--chaos-cancel-after", type=float, default=d.cancel_after_s,
                    help="seconds after which a cancelling client gives up "
                         "(default: %(default)s)")
    sv.add_argument("--chaos-max-request-bytes", type=int, default=d.max_request_bytes,
                    help="the server's --max-request-bytes; the oversize body is one byte "
                         "more (default: %(default)s)")


def cmd_bench_serve(args) -> int:

    from specmoe.bench.serve import render_markdown, run_serve_bench, write_report
    if args.chaos:
        return cmd_bench_chaos(args)
    results = run_serve_bench(bench_serve_config(args))
    out = (Path(args.out) if args.out else fresh_out_dir("bench-serve"))
    print(render_markdown(results))
    for path in write_report(results, out):
        print(path)
    return 1 if results["summary"]["num_5xx"] else 0


def bench_serve_config(args):
    import os

    from specmoe.bench.serve import ServeBenchConfig
    return ServeBenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model,
        api_key=args.api_key or os.environ.get("SPECMOE_API_KEY"), endpoint=args.endpoint,
        datasets=args.datasets, num_requests=args.num_requests,
        duration_s=args.duration, request_rate=args.request_rate,
        concurrency=args.concurrency, max_tokens=args.max_tokens,
        temperature=args.temperature, ignore_eos=args.ignore_eos, slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot, seed=args.seed)


def cmd_bench_chaos(args) -> int:
    """`bench serve --chaos RATE`: 0 when every check passed, else 1."""

    from specmoe.bench.chaos import (ChaosConfig, is_passed, render_chaos_markdown,
                                     run_chaos_bench)
    from specmoe.bench.serve import write_report
    chaos = ChaosConfig(rate=args.chaos, grace_s=args.chaos_grace,
                        cancel_after_s=args.chaos_cancel_after,
                        max_request_bytes=args.chaos_max_request_bytes)
    results = run_chaos_bench(bench_serve_config(args), chaos)
    out = (Path(args.out) if args.out else fresh_out_dir("bench-serve-chaos"))
    report = render_chaos_markdown(results)
    print(report)
    for path in write_report(results, out, report):
        print(path)
    return 0 if is_passed(results) else 1


def cmd_bench_throughput(args) -> int:
    """0 when every run succeeded, else 1 (the report lists the errors)."""

    from specmoe.bench.throughput import (ThroughputBenchConfig, num_failed_runs,
                                          run_throughput_bench)
    from specmoe.bench.throughput_report import (bound_sentence, caveats, target_sentence,
                                                 write_report)
    cfg = ThroughputBenchConfig(
        model=args.model, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
        spec_disable_by_batch_size=args.speculative_disable_by_batch_size,
        dtype=args.dtype, quantization=args.quantization,
        draft_quantization=args.draft_quantization,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens, max_tokens_range_ratio=args.max_tokens_range_ratio,
        reps=args.reps,
        datasets=args.datasets, num_requests=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        num_threads=args.threads, policies=args.speculative_policy,
        batch_size_table=args.speculative_batch_size_table, aa_control=args.aa_control,
        spec_bench_categories=args.spec_bench_categories,
        expert_parallel_size=args.expert_parallel_size,
        expert_parallel_dispatch=args.expert_parallel_dispatch,
        expert_placement=args.expert_placement,
        expert_parallel_timeout_s=args.expert_parallel_timeout, interleave=args.interleave,
        slice_seconds=args.slice_seconds, arrival=args.arrival)
    out = (Path(args.out) if args.out else fresh_out_dir("throughput"))
    results = run_throughput_bench(cfg)
    for path in write_report(results, out):
        print(path)
    for line in (target_sentence(results["target"]), bound_sentence(results)):
        if line:
            print(line.replace("**", ""))
    for caveat in caveats(results):
        print(f"caveat: {caveat}")
    if failed := num_failed_runs(results):
        print(f"specmoe: error: {failed} of {len(results['runs'])} runs failed, first: "
              f"{next(r['error'] for r in results['runs'] if 'error' in r)}", file=sys.stderr)
        return 1
    return 0


def add_bench_moe_parser(bench) -> None:
    from specmoe.analysis.study_config import PUBLISHED_OVERLAP
    from specmoe.bench.moe import MoEBenchConfig
    d = MoEBenchConfig()
    mo = bench.add_parser("moe", help="MoE expert backends against each other and the "
                                      "roofline: one MoE layer and the whole-model step of "
                                      "the study presets against T")
    mo.add_argument("--presets", type=comma_list(), default=None,
                    help="MoE presets of the study (default: all of them)")
    mo.add_argument("--num-tokens", type=comma_list(int),
                    default=",".join(map(str, d.num_tokens)),
                    help="T values, ascending (default: %(default)s)")
    mo.add_argument("--backends", type=comma_list(), default=",".join(d.backends),
                    help="MoE backends, run in turn in every repetition; 'grouped' (the "
                         "loop over experts) is the baseline of the ratios "
                         "(default: %(default)s)")
    mo.add_argument("--parts", type=comma_list(), default=",".join(d.parts),
                    help="layer (one MoE layer), model (the whole-model step) or both "
                         "(default: %(default)s)")
    mo.add_argument("--repeats", type=int, default=d.repeats,
                    help="repetitions of every point; min and median reported "
                         "(default: %(default)s)")
    mo.add_argument("--overlap", type=float, default=PUBLISHED_OVERLAP,
                    help="adjacent-token expert overlap of the correlated routing "
                         "(default: %(default)s, the study's)")
    mo.add_argument("--context-len", type=int, default=None,
                    help=f"tokens in the KV cache of the whole-model step (default: "
                         f"{d.context_len}; 32 with --smoke)")
    mo.add_argument("--scale-layers", type=float, default=1.0,
                    help="multiply the presets' depth (the whole-model step; default: "
                         "%(default)s)")
    mo.add_argument("--smoke", action="store_true",
                    help="tiny shapes with the presets' N and k (H=128, 2 layers), small "
                         "probes, no cache flush, one thread unless --threads: checks the "
                         "bench in seconds, measures nothing")
    mo.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"])
    mo.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if any)")
    mo.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's)")
    mo.add_argument("--seed", type=int, default=d.seed)
    mo.add_argument("--out", default=None,
                    help="report directory (default: out/bench-moe-<date>-<time>)")


def cmd_bench_moe(args) -> int:
    import dataclasses

    import torch

    from specmoe.analysis.presets import PRESETS, last_level_cache_bytes
    from specmoe.analysis.routing_gen import CorrelatedRouting
    from specmoe.analysis.verify_cost import build_synthetic
    from specmoe.bench.moe import MoEBenchConfig, MoECase, run_moe_bench
    from specmoe.bench.moe_report import target_summary, write_report
    from specmoe.loader.model_loader import resolve_device
    moe_names = [n for n, p in PRESETS.items() if p.is_moe]
    names = args.presets or moe_names
    if unknown := [n for n in names if n not in moe_names]:
        raise ValueError(f"invalid presets {unknown}: choose MoE presets from {moe_names}")
    if not args.scale_layers > 0:
        raise ValueError(f"invalid --scale-layers={args.scale_layers}: must be > 0")
    context_len = args.context_len if args.context_len is not None else (
        32 if args.smoke else MoEBenchConfig.context_len)
    cfg = MoEBenchConfig(
        presets=names, num_tokens=args.num_tokens, backends=args.backends, parts=args.parts,
        repeats=args.repeats, overlap=args.overlap, context_len=context_len,
        dtype=args.dtype, device=str(resolve_device(args.device)), smoke=args.smoke,
        seed=args.seed,
        cache_bytes=None if args.smoke else last_level_cache_bytes(),
        probe_bytes=(64 << 20) if args.smoke else None, flush_bytes=0 if args.smoke else None)
    apply_threads(args)
    max_len = context_len + max(cfg.num_tokens)

    def case(name: str) -> MoECase:
        p = PRESETS[name].scaled(args.scale_layers)
        if args.smoke:  # the preset's N, k and layout (MLA, shared experts), tiny widths
            p = dataclasses.replace(p, intermediate_size=max(32, p.intermediate_size // 16),
                                    num_layers=p.first_dense_layers + 2, hidden_size=128)
        return MoECase(p.name, p.description, p.arch(),
                       CorrelatedRouting(p.num_experts, p.top_k, args.overlap),
                       lambda: build_synthetic(p, cfg.dtype, cfg.device, cfg.seed, max_len,
                                               keep_dense=True))  # backends switch

    cases = [case(n) for n in names]  # a bad shape or overlap fails before any timing
    out = (Path(args.out) if args.out else fresh_out_dir("bench-moe"))
    started, threads = time.perf_counter(), torch.get_num_threads()
    if args.smoke and args.threads is None:
        torch.set_num_threads(1)  # tiny shapes: more threads only add overhead
    try:
        results = run_moe_bench(cfg, cases, progress=lambda m: print(
            f"[{time.perf_counter() - started:6.1f} s] {m}", file=sys.stderr, flush=True))
    finally:
        if args.smoke and args.threads is None:
            torch.set_num_threads(threads)
    for path in write_report(results, out):
        print(path)
    print("\n".join(target_summary(results)))
    return 0


def cmd_bench_spec(args) -> None:

    from specmoe.bench.report import write_report
    from specmoe.bench.spec import SpecBenchConfig, run_spec_bench
    cfg = SpecBenchConfig(
        target=args.target, draft=args.draft, dtype=args.dtype, quantization=args.quantization,
        draft_quantization=None if args.draft_quantization == "none" else
        args.draft_quantization, datasets=args.datasets, num_prompts=args.num_prompts,
        spec_bench_categories=args.spec_bench_categories, proposers=args.proposers,
        ks=args.ks, temperatures=args.temperatures, max_tokens=args.max_tokens,
        peers=args.peers)
    results = run_spec_bench(cfg)
    for path in write_report(results, Path(args.out)):
        print(path)


def cmd_generate(args) -> None:
    from specmoe import SamplingParams
    # Validate the cheap things before spending seconds on loading.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    check_trace_path(args.routing_trace)
    with reporting(StderrProgress()):
        llm = llm_from_args(args, speculative_from_args(args))
    try:
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat \
            else args.prompt
        if args.routing_trace or not args.stream:
            out = (generate_with_trace(llm, prompt, params, args.routing_trace)
                   if args.routing_trace else llm.generate(prompt, params)[0])
            print(out.text)
        else:
            out = stream_generate(llm, prompt, params, sys.stdout)
            print()
    finally:
        llm.shutdown()
    print(format_stats(out), file=sys.stderr)


def stream_generate(llm, prompt, params, stream):
    """Generate one completion, writing its text to `stream` as tokens are accepted (the
    detokenizer's complete characters, held back where a stop string may be starting;
    `engine.detokenizer`); returns the finished output, whose text was written in full."""
    from specmoe.engine.detokenizer import IncrementalDetokenizer, safe_stream_text
    req = llm.make_request(prompt, params)
    llm.add_request(req)
    detokenizer, sent = IncrementalDetokenizer(llm.processor.decode), ""
    try:
        while True:
            finished = llm.step()
            text = (finished[0].text if finished else safe_stream_text(
                detokenizer.update(req.output_token_ids), params.stop))
            if text.startswith(sent) and len(text) > len(sent):
                stream.write(text[len(sent):])
                stream.flush()
                sent = text
            if finished:
                return finished[0]
    finally:  # an error or Ctrl-C must not leave the request holding KV cache blocks
        llm.engine.abort_request(req.request_id)


def format_stats(out) -> str:
    s, m = out.spec_stats, out.metrics
    lines = [f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
             f"prefill {m.prefill_time_s:.3f} s, decode {m.decode_tokens_per_s(len(out.token_ids)):.2f} tok/s"]
    if s.num_drafts:
        per_pos = ", ".join(f"{a:.2f}" for a in s.acceptance_per_position())
        lines.append(f"--- drafts {s.num_drafts}, drafted {s.num_draft_tokens}, accepted "
                     f"{s.num_accepted_tokens}, acceptance rate {s.acceptance_rate:.3f}, mean "
                     f"acceptance length {s.mean_acceptance_length:.2f}, per position [{per_pos}]")
        lines.append(f"--- drafting {s.draft_time_s:.3f} s, verifying {s.verify_time_s:.3f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "serve":
            cmd_serve(args)
        elif args.command == "bench" and args.bench == "throughput":
            return cmd_bench_throughput(args)
        elif args.command == "bench" and args.bench == "serve":
            return cmd_bench_serve(args)
        elif args.command == "bench" and args.bench == "moe":
            return cmd_bench_moe(args)
        elif args.command == "bench" and args.bench == "peers":
            from specmoe.entrypoints.peers_cli import cmd_bench_peers
            return cmd_bench_peers(args)
        elif args.command == "bench":
            cmd_bench_spec(args)
        elif args.command == "demo":
            from specmoe.entrypoints.demo import run_demo
            run_demo(args)
        elif args.command == "models":
            return cmd_models(args)
        elif args.command == "routing":
            return cmd_routing(args)
        elif args.command == "expert-placement":
            return cmd_expert_placement(args)
        elif args.command == "study":
            from specmoe.entrypoints.study_cli import cmd_study
            return cmd_study(args)
        elif args.command == "advise":
            from specmoe.entrypoints.advise_cli import cmd_advise
            return cmd_advise(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
