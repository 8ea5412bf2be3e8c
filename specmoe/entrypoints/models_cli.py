"""`specmoe models`: install, list, carve models, measure a carved model's card, and write a
study preset as a random-weight checkpoint."""

from __future__ import annotations

import sys


def add_models_parser(sub) -> None:
    models = sub.add_parser("models", help="install, list, carve, synth and card models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    install = models_sub.add_parser("install", help="fetch, join and verify models")
    install.add_argument("names", nargs="+", metavar="NAME",
                         help="model alias, group or carve recipe (see `specmoe models list`)")
    models_sub.add_parser("list", help="models, their roles and whether they are installed")
    add_carve_parser(models_sub)
    add_card_parser(models_sub)
    add_synth_parser(models_sub)


def add_synth_parser(models_sub) -> None:
    from specmoe.analysis.presets import PRESETS
    from specmoe.loader.gguf_synth import LIKE, TYPES
    synth = models_sub.add_parser(
        "synth", help="write a random-weight model: a study preset (HF checkpoint) or a real "
                      "model's shape (GGUF file)",
        description="PRESET: a study preset in Mixtral's layout (a dense one in Llama's) as "
                    "an HF checkpoint with a borrowed tokenizer (DeepSeek-shaped presets are "
                    "refused). --like NAME: a GGUF file with the exact shape, tensor names "
                    "and metadata of a real model, seeded random weights in --type, written "
                    "tensor by tensor in bounded memory.")
    synth.add_argument("preset", metavar="PRESET", nargs="?", choices=sorted(PRESETS),
                       help=f"one of {sorted(PRESETS)}")
    synth.add_argument("--like", choices=sorted(LIKE), default=None,
                       help="a real model's shape, written as a GGUF file")
    synth.add_argument("--type", default="Q8_0", choices=sorted(TYPES),
                       help="with --like: the matrices' GGUF type (default: %(default)s)")
    synth.add_argument("--layers", type=int, default=None,
                       help="with --like: fewer decoder layers than the model's (a first look)")
    synth.add_argument("--out", required=True,
                       help="output directory (PRESET) or .gguf file (--like)")
    synth.add_argument("--tokenizer-from", default=None,
                       help="PRESET: alias or HF directory whose tokenizer (and vocabulary "
                            "size) the checkpoint takes (default tiny-moe); --like: a GGUF "
                            "file or alias whose tokenizer is padded to the shape's "
                            "vocabulary (default smollm2-135m)")
    synth.add_argument("--seed", type=int, default=0)


def cmd_synth(args) -> int:
    from specmoe.loader.aliases import resolve_model_path
    if (args.preset is None) == (args.like is None):
        raise ValueError("models synth takes a PRESET or --like NAME (one of them)")
    if args.like is not None:
        return _synth_like(args)
    from specmoe.analysis.preset_export import export_preset
    from specmoe.analysis.presets import PRESETS
    preset = PRESETS[args.preset]
    try:
        src = resolve_model_path(args.tokenizer_from or "tiny-moe")
        out = export_preset(preset, args.out, src, args.seed, progress=lambda layer: print(
            f"layer {layer + 1}/{preset.num_layers} written", flush=True))
    except (ValueError, FileNotFoundError) as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _synth_like(args) -> int:
    from specmoe.loader.aliases import resolve_model_path
    from specmoe.loader.gguf_synth import shape_like, write_like
    from specmoe.utils.progress import StderrProgress, reporting
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"invalid --layers={args.layers}: must be >= 1")
    shape = shape_like(args.like, **({} if args.layers is None else
                                     {"num_layers": args.layers}))
    donor = resolve_model_path(args.tokenizer_from or "smollm2-135m")
    if donor.suffix != ".gguf":
        raise ValueError(f"--tokenizer-from {donor}: --like takes a GGUF file's tokenizer")
    with reporting(StderrProgress()):
        out = write_like(shape, args.type, args.out, donor, args.seed,
                         name=f"synthetic {args.like} {args.type}")
    print(out)
    return 0


def add_carve_parser(models_sub) -> None:
    carve = models_sub.add_parser(
        "carve", help="turn a dense Llama/Qwen2 model into a Qwen2-MoE checkpoint",
        description="Groups each FFN's neurons into experts on calibration text, fits a "
                    "router and trains every MoE layer to reproduce the dense FFN on the "
                    "carved model's own inputs (resumable: rerun the same command).")
    carve.add_argument("source", metavar="SRC", help="alias, HF directory or GGUF file")
    carve.add_argument("--num-experts", type=int, required=True, help="routed experts N")
    carve.add_argument("--top-k", type=int, required=True, help="routed experts per token")
    carve.add_argument("--shared-experts", type=int, default=0,
                       help="always-on experts of the same width (default 0)")
    carve.add_argument("--out", required=True, help="output directory")
    carve.add_argument("--layers", type=int, nargs="+", default=None,
                       help="carve only these layers (default all; the rest stay dense)")
    carve.add_argument("--calibration-windows", type=int, default=64)
    carve.add_argument("--window", type=int, default=256, help="tokens per window")
    carve.add_argument("--train-steps", type=int, default=200,
                       help="Adam steps per layer (0: training-free carve)")
    carve.add_argument("--train-batch", type=int, default=512, help="tokens per step")
    carve.add_argument("--seed", type=int, default=0)
    carve.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    carve.add_argument("--corpus-dir", default=None,
                       help="calibration .txt files (default: the repository's data/corpus)")
    carve.add_argument("--eval-windows", type=int, default=4,
                       help="held-out windows per corpus file for the perplexity report "
                            "in OUT/carve.json (0: none)")
    carve.add_argument("--no-progress", action="store_true")


def add_card_parser(models_sub) -> None:
    card = models_sub.add_parser(
        "card", help="measure a carved MoE against its dense original (model card)",
        description="Held-out perplexity per domain, greedy agreement, acceptance of a draft "
                    "and of n-gram at K = 1..K_max against the carved and the dense target, "
                    "and the carved model's routing, all through the engine; writes "
                    "card.json, README.md and acceptance_vs_k.png into OUT.")
    card.add_argument("model", metavar="MODEL", help="the carved MoE (directory or alias)")
    card.add_argument("--dense", required=True, help="its dense original")
    card.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model")
    card.add_argument("--out", required=True, help="output directory")
    card.add_argument("--num-prompts", type=int, default=2,
                      help="prompts per dataset and Spec-Bench category (default 2)")
    card.add_argument("--max-tokens", type=int, default=96, help="greedy tokens per prompt")
    card.add_argument("--max-k", type=int, default=8)
    card.add_argument("--check-k", type=int, default=4,
                      help="K of the real speculative runs that check the replay (0: none)")
    card.add_argument("--eval-windows", type=int, default=4,
                      help="held-out windows per corpus file")
    card.add_argument("--window", type=int, default=256)
    card.add_argument("--corpus-dir", default=None)


def cmd_card(args) -> int:
    from specmoe.analysis.model_card import CardConfig, measure_card
    from specmoe.analysis.model_card_report import write_card
    cfg = CardConfig(model=args.model, dense=args.dense, draft=args.draft,
                     num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                     max_k=args.max_k, check_k=args.check_k, eval_windows=args.eval_windows,
                     window=args.window, corpus_dir=args.corpus_dir)
    for path in write_card(measure_card(cfg), args.out):
        print(path)
    return 0


def cmd_models(args) -> int:
    from specmoe.loader import model_store
    from specmoe.loader.aliases import list_all_models
    if args.models_command == "list":
        print(format_model_rows(list_all_models()))
        for group, aliases in model_store.GROUPS.items():
            print(f"group {group}: {' + '.join(aliases)}")
        from specmoe.carve.recipes import RECIPES
        for name, recipe in RECIPES.items():
            print(f"carve {name}: {recipe.alias} from {recipe.source}")
        return 0
    if args.models_command == "carve":
        return cmd_carve(args)
    if args.models_command == "card":
        return cmd_card(args)
    if args.models_command == "synth":
        return cmd_synth(args)
    from specmoe.carve.recipes import RECIPES
    recipes = [n for n in args.names if n in RECIPES]
    try:
        model_store.install([n for n in args.names if n not in RECIPES], progress=True)
        for name in recipes:
            install_carved(name)
    except model_store.ModelInstallError as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 1
    return 0


def install_carved(name: str) -> None:
    from specmoe.carve.recipes import RECIPES, install_recipe
    result = install_recipe(name)
    recipe = RECIPES[name]
    print(f"{recipe.alias}: {result.path} (model.safetensors sha256 {result.sha256})")
    if result.matches_record is False:
        print(f"specmoe: warning: {recipe.alias} differs from the carve recorded on "
              f"{recipe.recorded_on} (sha256 {recipe.sha256}): another CPU or library "
              "version rounds differently; the model works, its measured quality is the "
              "recorded carve's", file=sys.stderr)


def cmd_carve(args) -> int:
    from specmoe.carve.carve import CarveSettings, carve
    from specmoe.carve.train import TrainSettings
    settings = CarveSettings(
        num_experts=args.num_experts, top_k=args.top_k, shared_experts=args.shared_experts,
        layers=None if args.layers is None else tuple(sorted(set(args.layers))),
        calibration_windows=args.calibration_windows, window=args.window, seed=args.seed,
        train=TrainSettings(steps=args.train_steps, batch=args.train_batch), dtype=args.dtype)
    carve(args.source, args.out, settings, args.corpus_dir, progress=not args.no_progress,
          eval_windows_per_file=args.eval_windows)
    print(args.out)
    return 0


def format_model_rows(rows) -> str:
    """The `models list` table: an installed model's size and path; for one not installed,
    its download size where known and the command that installs it."""
    from specmoe.carve.recipes import RECIPES
    install_name = {recipe.alias: name for name, recipe in RECIPES.items()}
    lines = [f"{'alias':<24} {'role':<7} {'size':>10} {'installed':<9} path"]
    for r in rows:
        size = f"{r.size_bytes / 1e6:>7.1f} MB" if r.size_bytes else f"{'-':>10}"
        where = (str(r.path) if r.is_installed else "not installed: specmoe models install "
                 f"{install_name.get(r.alias, r.alias)}")
        lines.append(f"{r.alias:<24} {r.role:<7} {size} {'yes' if r.is_installed else 'no':<9} "
                     f"{where}")
    return "\n".join(lines)
