"""argparse helpers shared by the command-line tools: list values, and the model,
speculation and thread options with the LLM they build."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from specmoe.config import (EXPERT_PARALLEL_DISPATCH, KV_CACHE_DTYPES, MOE_BACKEND_CHOICES,
                            SPECULATIVE_POLICIES, parse_draft)
from specmoe.loader.aliases import DEFAULT_MODEL


def comma_list(kind: Callable = str) -> Callable[[str], list]:
    """An argparse `type`: "a,b,c" -> [kind("a"), kind("b"), kind("c")], blanks around items
    and empty items dropped. A bad item is an argparse error that names the whole value (so
    `--ks 2,x` exits 2 with a usage line, not a traceback)."""
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"invalid list {text!r}: expected comma-separated {kind.__name__} values"
            ) from exc
    parse.__name__ = f"comma list of {kind.__name__}"
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF model directory, .gguf file or alias (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activations and unquantised weights. auto (the default): bfloat16 "
                        "where the native CPU kernels run (x86-64 with AVX-512; several times "
                        "faster, output still identical with and without speculation), "
                        "float32 elsewhere")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="weight-only quantisation of the target's dense projections; gguf: "
                   "a .gguf file's own blocks at their types (CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the target's KV cache: auto (the model's dtype), bfloat16, float32, "
                        "or int8 (one scale per token and KV head; about half of bfloat16's "
                        "bytes; not for MLA models)")
    p.add_argument("--moe-backend", default="auto", choices=list(MOE_BACKEND_CHOICES),
                   help="how a MoE model's routed experts run: fused (one native call per "
                        "layer, CPU bf16), grouped (a loop over active experts on the native "
                        "kernel), grouped_mm (sorted tokens, two grouped matmuls, any "
                        "device), reference (per token, slow). auto (the default): fused "
                        "where the native bf16 kernels run, else grouped_mm")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, fixed (default: one per core, fewer while "
                        "other processes keep cores busy)")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="shard a MoE model's experts over this many processes on this "
                        "machine, one torch thread each (default: 1; docs/serving.md)")
    add_expert_parallel_mode_args(p)


def add_expert_parallel_mode_args(p: argparse.ArgumentParser) -> None:
    """--expert-parallel-dispatch, --expert-placement and --expert-parallel-timeout (with
    --expert-parallel-size > 1)."""
    p.add_argument("--expert-parallel-dispatch", default="replicated",
                   choices=list(EXPERT_PARALLEL_DISPATCH),
                   help="how expert-parallel ranks exchange tokens: replicated (one "
                        "all_reduce per MoE layer) or all_to_all (each rank dispatches its "
                        "slice of the tokens; default: %(default)s)")
    p.add_argument("--expert-placement", default="contiguous", metavar="contiguous|PATH",
                   help="which rank holds each expert: contiguous blocks (the default) or "
                        "a placement file from `specmoe expert-placement` (balanced from "
                        "measured load)")
    p.add_argument("--expert-parallel-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="seconds a collective waits for the other ranks: a rank that died "
                        "or hangs fails the requests after at most this long (default: "
                        "%(default)s)")


def expert_parallel_kwargs(args) -> dict:
    """The LLM keyword arguments of the expert-parallel options."""
    return {"expert_parallel_size": args.expert_parallel_size,
            "expert_parallel_dispatch": args.expert_parallel_dispatch,
            "expert_placement": args.expert_placement,
            "expert_parallel_timeout_s": args.expert_parallel_timeout}


def apply_threads(args) -> None:
    """Set torch's intra-op thread count from --threads (if given).

    Raises:
        ValueError: --threads below 1.
    """
    if args.threads is None:
        return
    if args.threads < 1:
        raise ValueError(f"invalid --threads={args.threads}: must be >= 1")
    import torch

    from specmoe.utils.threads import pin_thread_count
    torch.set_num_threads(args.threads)
    pin_thread_count()  # the engine no longer adapts it to other processes' load


# The speculation flags' defaults; their parser defaults are None, so that a flag given
# without --draft, or against another flag, can be refused (`speculative_from_args`).
SPEC_DEFAULTS = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
_SPEC_FLAGS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "draft_quantization", "speculative_disable_by_batch_size", "speculative_policy",
               "speculative_batch_size_table")


def add_spec_args(p: argparse.ArgumentParser, default_draft: str | None = None) -> None:
    p.add_argument("--draft", default=default_draft,
                   help="'ngram' for prompt lookup, 'self:experts=K' for a MoE target "
                        "drafting with K of its routed experts per token, or a draft model "
                        "path/alias")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="K, draft tokens verified per step (default: 4; 0: speculation off)")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="(default: 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="(default: 3)")
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="weight-only quantisation of the draft model (int4: ~3x cheaper "
                        "drafting on CPU)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="pause speculation while at least this many requests run (large "
                        "batches are compute-bound; `specmoe bench throughput` shows where "
                        "speculation stops paying)")
    p.add_argument("--speculative-policy", default=None, choices=SPECULATIVE_POLICIES,
                   help="how each step's K is chosen: static (the default: every request "
                        "drafts K), "
                        "batch_size_table (K by the number of running requests, from "
                        "--speculative-batch-size-table) or adaptive (per request and step, "
                        "from measured acceptance and step times; at most K)")
    p.add_argument("--speculative-batch-size-table", type=json_dict, default=None,
                   help="JSON ranges of running requests to K, vLLM-style, e.g. "
                        "'{\"1-4\": 4, \"5-16\": 2, \"17-4096\": 0}' (implies "
                        "--speculative-policy batch_size_table)")


def json_dict(text: str) -> dict:
    """argparse type: a JSON object (ArgumentTypeError naming the text otherwise)."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def speculative_from_args(args) -> dict | None:
    """The `SpeculativeConfig` fields of `add_spec_args`' flags (None without --draft); the
    unset flags in `args` are set to their defaults (`SPEC_DEFAULTS`, policy "static", or
    "batch_size_table" with a table).

    Raises:
        ValueError: a speculation flag without --draft, or --speculative-batch-size-table
            with another --speculative-policy than batch_size_table. `-k 0` turns
            speculation off (None).
    """
    given = [f for f in _SPEC_FLAGS if getattr(args, f) is not None]
    if not args.draft and given:
        raise ValueError(f"--{given[0].replace('_', '-')} needs --draft (ngram or a draft "
                         "model): without it nothing is speculated")
    table = args.speculative_batch_size_table
    if table is not None and args.speculative_policy not in (None, "batch_size_table"):
        raise ValueError(f"--speculative-batch-size-table sets the policy batch_size_table, "
                         f"which contradicts --speculative-policy {args.speculative_policy}")
    for name, value in SPEC_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.speculative_policy is None:
        args.speculative_policy = "batch_size_table" if table is not None else "static"
    if not args.draft or args.num_speculative_tokens == 0:  # -k 0: speculation off
        return None
    spec = {"num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            "draft_quantization": args.draft_quantization,
            "disable_by_batch_size": args.speculative_disable_by_batch_size,
            "policy": args.speculative_policy, "batch_size_table": table}
    return parse_draft(args.draft) | spec


def llm_from_args(args, speculative: dict | None):
    """An LLM built from the model and speculation options of `add_model_args`."""
    from specmoe import LLM
    apply_threads(args)
    return LLM(args.model, speculative=speculative, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, quantization=args.quantization,
               moe_backend=args.moe_backend, kv_cache_dtype=args.kv_cache_dtype,
               **expert_parallel_kwargs(args))


def fresh_out_dir(prefix: str) -> Path:
    """out/PREFIX-YYYYmmdd-HHMMSS, with -2, -3, ... added where a run of the same second
    already wrote one: a default output folder never overwrites an earlier run's."""
    base = Path("out") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out
