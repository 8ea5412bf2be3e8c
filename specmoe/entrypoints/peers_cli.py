"""`specmoe bench peers`: specmoe beside llama.cpp on one GGUF file (`analysis.gguf_peers`)."""

from __future__ import annotations

from pathlib import Path

from specmoe.entrypoints.args import comma_list, fresh_out_dir


def add_peers_parser(bench) -> None:
    from specmoe.analysis.gguf_peers import PEERS, PeersBenchConfig
    d = PeersBenchConfig.__dataclass_fields__
    p = bench.add_parser("peers", help="specmoe and llama.cpp on one GGUF file: load, RSS, "
                                       "prefill, decode, verification cost")
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--peers", type=comma_list(), default=",".join(PEERS),
                   help="peer engines beside specmoe, comma-separated, or '' for none "
                        "(default: %(default)s; llama-cpp needs `make peers`)")
    for name, help_text in (("reps", "fresh processes per engine, alternated"),
                            ("threads", "threads of every engine"),
                            ("context", "tokens before the timed forwards, and the prefill"),
                            ("max_t", "the largest T of Tt(1, T)"),
                            ("decode_tokens", "single-token forwards timed for decode")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name].default,
                       help=f"{help_text} (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="report directory (default: out/bench-peers-<date>-<time>)")


def cmd_bench_peers(args) -> int:
    """Runs the bench, writes results.json and report.md, prints the report; 1 when an
    engine failed every run."""
    from specmoe.analysis.gguf_peers import PeersBenchConfig, run_peers_bench, write_report
    cfg = PeersBenchConfig(model=args.model, peers=[p for p in args.peers if p],
                           reps=args.reps, threads=args.threads, context=args.context,
                           max_t=args.max_t, decode_tokens=args.decode_tokens)
    result = run_peers_bench(cfg)
    report = write_report(result, Path(args.out) if args.out else fresh_out_dir("bench-peers"))
    print(report.read_text())
    print(f"report: {report}")
    return 1 if any(not s["runs"] for s in result["summary"].values()) else 0
