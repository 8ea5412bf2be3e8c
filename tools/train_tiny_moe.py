"""Train the tiny fixture models `tiny-moe` (OLMoE target) and `tiny-moe-draft` (Llama draft).

Seeded and reproducible on CPU. From the domain corpus (`data/corpus/*.txt` of this repository, or
`--corpus-dir`), the last `--val-fraction` of every file (cut at a line boundary) is held out
for validation; on the rest we train

1. a byte-level BPE tokenizer (`tokenizers`, vocabulary `--vocab-size`, special tokens
   <|endoftext|>, <|im_start|>, <|im_end|>, a ChatML chat template);
2. an MoE target, `transformers.OlmoeForCausalLM` (Muennighoff et al. 2024, arXiv 2409.02060)
   with the router load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv
   2101.03961, eq. 4) added with `router_aux_loss_coef` (`output_router_logits=True`);
3. a dense draft, `transformers.LlamaForCausalLM`, several times smaller, same tokenizer.

Both are next-token language models on random windows of `--seq-len` tokens of the training
stream (AdamW, linear warmup, cosine decay, gradient clipping, optional bf16 autocast), saved
in HuggingFace format (config.json, model.safetensors in bf16, tokenizer files) plus
`train_log.json` (arguments, step losses, validation losses, wall time).

    python tools/train_tiny_moe.py --threads 2     # full run (see MODEL_CARD.md for its time)
    python tools/train_tiny_moe.py --smoke --out-dir /tmp/tiny   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "specmoe" / "models_data"
EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------- data

def default_corpus_dir() -> Path:
    """The domain corpus kept in this repository (`data/corpus/`, with its license)."""
    return Path(__file__).resolve().parent.parent / "data" / "corpus"


@dataclass
class CorpusSplit:
    """Train and validation text of every corpus file.

    Attributes:
        train: file stem -> training text (the head of the file).
        val: file stem -> held-out text (the tail of the file).
    """

    train: dict[str, str]
    val: dict[str, str]


def split_corpus(corpus_dir: Path, val_fraction: float,
                 max_chars_per_file: int | None = None) -> CorpusSplit:
    """Hold out the last `val_fraction` of each *.txt file (cut after a newline).

    Args:
        max_chars_per_file: use only the first that many characters of each file (smoke).
    Raises:
        FileNotFoundError: when `corpus_dir` has no .txt files.
    """
    files = sorted(Path(corpus_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in corpus directory {corpus_dir}")
    split = CorpusSplit({}, {})
    for path in files:
        text = path.read_text(encoding="utf-8")[:max_chars_per_file]
        cut = int(len(text) * (1.0 - val_fraction))
        newline = text.find("\n", cut)
        cut = newline + 1 if newline >= 0 else cut
        split.train[path.stem], split.val[path.stem] = text[:cut], text[cut:]
    return split


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for `transformers`.

    Returns:
        a `PreTrainedTokenizerFast` with eos = pad = <|endoftext|> and a ChatML template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT,
                                   model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate the token ids of `texts`, each followed by <|endoftext|>.

    Returns:
        [num_tokens] int64.
    """
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def val_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Consecutive non-overlapping windows of seq_len + 1 tokens: [num_windows, seq_len + 1]."""
    num = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        num = min(num, max_windows)
    starts = torch.arange(num) * seq_len
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    """Random training windows: [batch_size, seq_len + 1] int64."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------- models

@dataclass
class ModelSpec:
    """Shape of one model. `num_experts` = 0 builds the dense Llama draft."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int = 0
    top_k: int = 0
    router_aux_loss_coef: float = 0.01


TARGET_SPEC = ModelSpec(hidden_size=256, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, num_experts=32, top_k=4)
DRAFT_SPEC = ModelSpec(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=3, num_key_value_heads=3)
SMOKE_TARGET_SPEC = ModelSpec(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, num_experts=8,
                              top_k=2)
SMOKE_DRAFT_SPEC = ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)


def build_config(spec: ModelSpec, tokenizer, max_positions: int):
    """An OlmoeConfig (MoE spec) or LlamaConfig (dense spec) with tied embeddings."""
    import transformers
    eot = tokenizer.convert_tokens_to_ids(EOT)
    common = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads,
                  num_key_value_heads=spec.num_key_value_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=eot, pad_token_id=eot,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    if spec.num_experts == 0:
        return transformers.LlamaConfig(**common)
    return transformers.OlmoeConfig(**common, num_experts=spec.num_experts,
                                    num_experts_per_tok=spec.top_k, norm_topk_prob=False,
                                    output_router_logits=True,
                                    router_aux_loss_coef=spec.router_aux_loss_coef)


def build_model(config, seed: int):
    """A freshly initialised causal LM (fp32, eager attention) for `config`."""
    import transformers
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa")


def count_params(model) -> int:
    """Parameters, counting tied embeddings once."""
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training

@dataclass
class TrainConfig:
    """Optimisation settings of one model."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True
    eval_every: int = 200
    log_every: int = 10


@dataclass
class TrainLog:
    """What one training run produced: per-step losses and periodic validation losses."""

    step_loss: list[float] = field(default_factory=list)
    step_aux_loss: list[float] = field(default_factory=list)
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    wall_time_s: float = 0.0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms or embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(model, batch: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy + coef * router aux loss, router aux loss or 0) on [B, T+1] windows."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=batch[:, :-1], use_cache=False)
    logits = out.logits.float()  # [B, T, vocab_size]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return loss, torch.zeros(())
    return loss + model.config.router_aux_loss_coef * aux.float(), aux.float()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats, fp32, no aux loss) over [N, T+1] windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i:i + batch_size]
        logits = model(input_ids=batch[:, :-1], use_cache=False,
                       output_router_logits=False).logits.float()  # [B, T, vocab_size]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + batch[:, 1:].numel()
    model.train()
    return total / count


def train(model, stream: torch.Tensor, val: torch.Tensor, cfg: TrainConfig, seed: int,
          name: str) -> TrainLog:
    """Train `model` in place on random windows of `stream`; returns the log."""
    gen = torch.Generator().manual_seed(seed)
    opt, log, start = make_optimizer(model, cfg), TrainLog(), time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, aux = lm_loss(model, sample_batch(stream, cfg.batch_size, cfg.seq_len, gen),
                            cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        log.step_loss.append(round(loss.item(), 4))
        log.step_aux_loss.append(round(aux.item(), 4))
        _report(step, cfg, log, model, val, name, start)
    log.wall_time_s = time.perf_counter() - start
    return log


def _report(step: int, cfg: TrainConfig, log: TrainLog, model, val: torch.Tensor, name: str,
            start: float) -> None:
    last = step + 1 == cfg.steps
    if (step + 1) % cfg.eval_every == 0 or last:
        log.val_loss.append((step + 1, round(evaluate(model, val), 4)))
    if (step + 1) % cfg.log_every == 0 or last:
        recent = log.step_loss[-cfg.log_every:]
        val_note = f" val {log.val_loss[-1][1]:.4f}" if log.val_loss else ""
        print(f"[{name}] step {step + 1}/{cfg.steps} loss {sum(recent) / len(recent):.4f} "
              f"aux {log.step_aux_loss[-1]:.4f} lr {lr_at(step, cfg):.2e}{val_note} "
              f"{time.perf_counter() - start:.0f}s", flush=True)


# ----------------------------------------------------------------------------- saving

def save(model, tokenizer, out_dir: Path, log: TrainLog, extra: dict) -> None:
    """Save weights (bf16 safetensors), config, tokenizer and train_log.json in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference default; training used True
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_class(out_dir / "tokenizer_config.json")
    record = {**extra, **asdict(log), "num_params": count_params(model)}
    (out_dir / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend", which 4.x cannot load;
    "PreTrainedTokenizerFast" loads in both."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-dir", type=Path, default=None,
                   help="default: data/corpus/ of this repository")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT,
                   help="writes tiny-moe/ and tiny-moe-draft/ here (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--target-steps", type=int, default=1600)
    p.add_argument("--draft-steps", type=int, default=1200)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-val-windows", type=int, default=48,
                   help="validation windows for the periodic evaluation during training")
    p.add_argument("--max-chars-per-file", type=int, default=None)
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="train in fp32 instead of bf16 autocast")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--only", choices=["target", "draft"], default=None)
    p.add_argument("--smoke", action="store_true",
                   help="tiny slice, tiny models, a few steps (for tests)")
    args = p.parse_args(argv)
    args.corpus_dir = args.corpus_dir or default_corpus_dir()
    if args.smoke:
        if args.out_dir == DEFAULT_OUT:
            p.error("--smoke needs --out-dir: it must not overwrite the bundled models")
        _apply_smoke(args)
    return args


def _apply_smoke(args: argparse.Namespace) -> None:
    args.max_chars_per_file = args.max_chars_per_file or 40_000
    args.vocab_size, args.seq_len, args.batch_size = 384, 32, 8
    args.target_steps = args.draft_steps = min(args.target_steps, 30)
    args.warmup_steps, args.eval_every, args.max_val_windows = 5, 10, 8
    args.target_lr = args.draft_lr = 1e-2


def train_one(kind: str, args, tokenizer, stream: torch.Tensor, val: torch.Tensor) -> TrainLog:
    """Build, train and save the target ("target") or the draft ("draft")."""
    specs = {"target": (SMOKE_TARGET_SPEC if args.smoke else TARGET_SPEC, args.target_steps,
                        args.target_lr, "tiny-moe"),
             "draft": (SMOKE_DRAFT_SPEC if args.smoke else DRAFT_SPEC, args.draft_steps,
                       args.draft_lr, "tiny-moe-draft")}
    spec, steps, lr, name = specs[kind]
    model = build_model(build_config(spec, tokenizer, args.seq_len), args.seed)
    print(f"[{name}] {count_params(model):,} parameters, {spec}", flush=True)
    cfg = TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=lr,
                      warmup_steps=args.warmup_steps, bf16=args.bf16,
                      eval_every=args.eval_every, log_every=1 if args.smoke else 10)
    log = train(model, stream, val, cfg, args.seed + 1, name)
    extra = {"args": {k: str(v) for k, v in vars(args).items()}, "spec": asdict(spec),
             "train_config": asdict(cfg), "num_train_tokens": stream.numel(),
             "num_val_tokens_eval": val[:, 1:].numel(),
             "threads": torch.get_num_threads()}
    save(model, tokenizer, args.out_dir / name, log, extra)
    return log


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    split = split_corpus(args.corpus_dir, args.val_fraction, args.max_chars_per_file)
    tokenizer = train_tokenizer(list(split.train.values()), args.vocab_size)
    stream = encode_stream(tokenizer, list(split.train.values()))
    val = val_windows(encode_stream(tokenizer, list(split.val.values())), args.seq_len,
                      args.max_val_windows)
    tokenizer.model_max_length = args.seq_len  # after encoding whole files: no length warning
    args.data_prep_s = round(time.perf_counter() - start, 1)
    print(f"tokenizer: {len(tokenizer)} tokens; train {stream.numel():,} tokens, "
          f"val windows {tuple(val.shape)} ({args.data_prep_s}s)", flush=True)
    for kind in ("target", "draft"):
        if args.only in (None, kind):
            train_one(kind, args, tokenizer, stream, val)
    print(f"total wall time {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
