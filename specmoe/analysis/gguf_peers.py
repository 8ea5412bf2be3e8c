"""`specmoe bench peers`: specmoe and llama.cpp on one GGUF file, each run a fresh process.

Per engine and repetition a child process (`specmoe.analysis.peer_probe`) loads the file and
measures load time, peak RSS, prefill tokens/s at the context length, decode tokens/s and
Tt(1, T) for T = 1..max_t. The engines alternate, the order reversed every other
repetition, and never hold the model at the same time (two copies of a 17 GB model do not
fit in 24 GiB). The report gives each figure's median over repetitions, decode GB/s from
the shape's active bytes per token (`active_bytes_per_token`) against each run's bandwidth
probe, and Tt(1, T)/Tt(1, 1).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specmoe.loader.gguf_header import GGUFHeader

PEERS = ("llama-cpp",)


@dataclass
class PeersBenchConfig:
    """Settings of one `bench peers` run (the CLI's flags).

    Attributes:
        model: the GGUF file.
        peers: peer engines beside specmoe (`PEERS`; empty: specmoe alone).
        reps: repetitions per engine, each a fresh process.
        threads: threads of every engine.
        context: tokens before the timed forwards (and the prefill's length).
        max_t: the largest T of Tt(1, T).
        decode_tokens: single-token forwards timed for decode tokens/s.
        timeout_s: the longest one child may run.
    """

    model: str
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    reps: int = 2
    threads: int = 2
    context: int = 512
    max_t: int = 9
    decode_tokens: int = 32
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if unknown := [p for p in self.peers if p not in PEERS]:
            raise ValueError(f"invalid peers {unknown}: choose from {PEERS}")
        for name in ("reps", "threads", "context", "max_t", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be >= 1")
        path = Path(self.model)
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"bench peers needs a .gguf file, not {self.model!r}")


def active_bytes_per_token(path: str | Path) -> int:
    """Weight bytes one decoded token reads from a GGUF file: every tensor, but one row of
    the token embedding (unless the head is tied to it) and top_k / num_experts of each
    routed-expert stack (`*_exps`)."""
    header = GGUFHeader(path)
    arch = header.get_field("general.architecture").contents()

    def value(key: str, default: int) -> int:
        f = header.get_field(f"{arch}.{key}")
        return int(f.contents()) if f is not None else default
    experts, used = value("expert_count", 0), value("expert_used_count", 0)
    names = {t.name for t in header.tensors}
    total = 0
    for t in header.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            total += t.n_bytes // int(t.shape[1])  # one row
        elif "_exps." in t.name and experts:
            total += t.n_bytes * used // experts
        else:
            total += t.n_bytes
    return total


def run_child(cfg: PeersBenchConfig, engine: str) -> dict:
    """One fresh process of `peer_probe`; its JSON line, or {"error": ...} when it failed."""
    cmd = [sys.executable, "-m", "specmoe.analysis.peer_probe", engine, cfg.model,
           "--threads", str(cfg.threads), "--context", str(cfg.context),
           "--max-t", str(cfg.max_t), "--decode-tokens", str(cfg.decode_tokens)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {cfg.timeout_s:.0f} s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        return {"engine": engine, "error": tail[0][-300:]}
    return json.loads(lines[-1])


def run_peers_bench(cfg: PeersBenchConfig, progress=print) -> dict:
    """Every run, alternated, and the summary; see the module docstring."""
    engines = ["specmoe", *cfg.peers]
    runs = []
    for rep in range(cfg.reps):
        for engine in engines if rep % 2 == 0 else engines[::-1]:
            progress(f"rep {rep + 1}/{cfg.reps}: {engine}")
            runs.append({"rep": rep, **run_child(cfg, engine)})
    active = active_bytes_per_token(cfg.model)
    return {"config": asdict(cfg), "active_bytes_per_token": active, "runs": runs,
            "summary": {e: summarize([r for r in runs if r["engine"] == e], active)
                        for e in engines}}


def summarize(runs: list[dict], active_bytes: int) -> dict:
    """Medians over an engine's successful runs (the errors listed)."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": len(ok), "errors": [r["error"] for r in runs if "error" in r]}
    if not ok:
        return out
    med = {k: statistics.median(r[k] for r in ok)
           for k in ("load_s", "peak_rss_gb", "prefill_tok_s", "decode_tok_s", "probe_gbs")}
    tt = {int(t): statistics.median(r["tt"][t] for r in ok) for t in ok[0]["tt"]}
    out.update(med, tt_ms={t: s * 1e3 for t, s in tt.items()},
               tt_ratio={t: s / tt[1] for t, s in tt.items()},
               decode_gbs=med["decode_tok_s"] * active_bytes / 1e9,
               unique_experts=ok[0].get("unique_experts") or {})
    return out


def render_markdown(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    ts = sorted({int(t) for s in summary.values() for t in s.get("tt_ratio", {})})
    lines = [f"# bench peers: {Path(cfg['model']).name}", "",
             f"{cfg['reps']} repetitions per engine (fresh processes, alternated), "
             f"{cfg['threads']} threads, context {cfg['context']} tokens; active weight bytes "
             f"per token {result['active_bytes_per_token'] / 1e6:.1f} MB.", "",
             "| engine | load s | peak RSS GB | prefill tok/s | decode tok/s | decode GB/s "
             "(probe) | " + " | ".join(f"T={t}" for t in ts) + " |",
             "|---" * (6 + len(ts)) + "|"]
    for engine, s in summary.items():
        if not s["runs"]:
            lines.append(f"| {engine} | failed: {'; '.join(s['errors'])} |")
            continue
        ratios = " | ".join(f"{s['tt_ratio'][t]:.2f}" for t in ts)
        lines.append(f"| {engine} | {s['load_s']:.1f} | {s['peak_rss_gb']:.2f} | "
                     f"{s['prefill_tok_s']:.1f} | {s['decode_tok_s']:.2f} | "
                     f"{s['decode_gbs']:.1f} ({s['probe_gbs']:.1f}) | {ratios} |")
    lines += ["", "T columns: Tt(1, T) / Tt(1, 1), one forward of T new tokens after the "
              "context (Tt(1, 1) in ms: " + ", ".join(
                  f"{e} {s['tt_ms'][1]:.1f}" for e, s in summary.items() if s["runs"]) + ")."]
    unique = {e: s["unique_experts"] for e, s in summary.items() if s.get("unique_experts")}
    for engine, u in unique.items():
        lines.append(f"Distinct experts per layer under the file's router ({engine}): " +
                     ", ".join(f"T={t}: {v}" for t, v in u.items()) + ".")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    report = out_dir / "report.md"
    report.write_text(render_markdown(result))
    return report
