"""Decode speed of specmoe's default OpenMP settings on a quiet machine and beside one busy
neighbour, against the other thread settings a user could pick.

The OpenMP runtime reads its wait policy once, when torch loads it, so every setting runs in
a process of its own. The processes load the model once, then wait; the parent asks each in
turn (rotating the order every repetition) for `--gens` greedy generations of
`--max-tokens` tokens (EOS ignored), first on the quiet machine, then with one CPU-bound
neighbour process (a Python busy loop) started beside them. Each reports decode tokens/s
(tokens after the first over decode time), so loading and prefill are left out.

Settings: `default` (the engine's thread governor, `specmoe.utils.threads`), `fixed` (one
thread per core whatever the load: `SPECMOE_FIXED_THREADS=1`, what specmoe did before the
governor), `passive` (fixed, with `OMP_WAIT_POLICY=passive`), `threads-1` (`--threads 1`),
and one fixed setting per `--spin-counts` value (`GOMP_SPINCOUNT`). Printed: min/median
tokens/s per setting, and the two ratios the defaults are held to, per repetition
(min/median): busy, default against the best setting of that repetition; quiet, default
against fixed.

    python bench/bench_threads.py [--model smollm2-135m] [--dtype float32] [--reps 3]
                                  [--gens 2] [--max-tokens 64] [--spin-counts 1000,100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def settings(spin_counts: list[int]) -> dict[str, tuple[dict, list[str]]]:
    """name -> (environment changes, child arguments)."""
    fixed = {"SPECMOE_FIXED_THREADS": "1"}
    out = {"default": ({}, []), "fixed": (fixed, []),
           "passive": ({**fixed, "OMP_WAIT_POLICY": "passive"}, []),
           "threads-1": ({}, ["--threads", "1"])}
    for n in spin_counts:
        out[f"spin-{n}"] = ({**fixed, "GOMP_SPINCOUNT": str(n)}, [])
    return out


def child(args) -> None:
    """Load once, then answer each line on stdin with a JSON list of decode tokens/s."""
    import torch

    from specmoe import LLM, SamplingParams
    from specmoe.utils.threads import pin_thread_count
    if args.threads:
        torch.set_num_threads(args.threads)
        pin_thread_count()
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPT, params)  # warm-up: first-call costs are not decoding
    print(json.dumps({"ready": torch.get_num_threads(),
                      "spin": os.environ.get("GOMP_SPINCOUNT"),
                      "policy": os.environ.get("OMP_WAIT_POLICY"),
                      "fixed": os.environ.get("SPECMOE_FIXED_THREADS")}), flush=True)
    for _ in sys.stdin:
        rates = []
        for _ in range(args.gens):
            out = llm.generate(PROMPT, params)[0]
            rates.append(out.metrics.decode_tokens_per_s(len(out.token_ids)))
        print(json.dumps({"rates": rates, "threads": torch.get_num_threads()}), flush=True)


def start(name: str, env_changes: dict, extra: list[str], args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "SPECMOE_FIXED_THREADS")}
    env.update(env_changes)
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype,
           "--gens", str(args.gens), "--max-tokens", str(args.max_tokens), *extra]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    info = json.loads(proc.stdout.readline())
    print(f"{name}: {info['ready']} threads, GOMP_SPINCOUNT={info['spin']}, "
          f"OMP_WAIT_POLICY={info['policy']}, SPECMOE_FIXED_THREADS={info['fixed']}",
          flush=True)
    return proc


def ask(proc: subprocess.Popen) -> dict:
    """{"rates": decode tokens/s per generation, "threads": the count after the last}."""
    proc.stdin.write("run\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def measure(procs: dict, args) -> dict[str, dict[str, list[list[float]]]]:
    """scenario -> setting -> one list of tokens/s per repetition."""
    names = list(procs)
    results = {"quiet": {n: [] for n in names}, "busy": {n: [] for n in names}}
    threads = {"quiet": {}, "busy": {}}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for scenario in ("quiet", "busy"):
            neighbour = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                         if scenario == "busy" else None)
            try:
                for n in order:
                    answer = ask(procs[n])
                    results[scenario][n].append(answer["rates"])
                    threads[scenario][n] = answer["threads"]
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            print(f"rep {rep + 1}/{args.reps} {scenario}: " + ", ".join(
                f"{n} {statistics.median(results[scenario][n][-1]):.1f} tok/s "
                f"({threads[scenario][n]} threads)" for n in names), flush=True)
    return results


def ratio_line(label: str, num: list[float], den: list[float]) -> str:
    ratios = [a / b for a, b in zip(num, den)]
    return f"{label}: {min(ratios):.2f}x min, {statistics.median(ratios):.2f}x median"


def report(results: dict) -> None:
    for scenario, by_name in results.items():
        print(f"\n{scenario}: decode tokens/s, min/median over repetitions x generations")
        for n, reps in by_name.items():
            flat = [x for r in reps for x in r]
            print(f"  {n:<16} {min(flat):7.1f} / {statistics.median(flat):7.1f}")
    med = {s: {n: [statistics.median(r) for r in reps] for n, reps in by.items()}
           for s, by in results.items()}
    best_busy = [max(vals) for vals in zip(*med["busy"].values())]
    print()
    print(ratio_line("busy neighbour, default / best setting of the repetition "
                     "(target >= 0.8)", med["busy"]["default"], best_busy))
    print(ratio_line("quiet, default / fixed threads as before (target >= 0.97)",
                     med["quiet"]["default"], med["quiet"]["fixed"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gens", type=int, default=2, help="generations per setting and repetition")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spin-counts", default="", help="extra GOMP_SPINCOUNT values, comma list")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    spin_counts = [int(x) for x in args.spin_counts.split(",") if x.strip()]
    procs = {name: start(name, env, extra, args)
             for name, (env, extra) in settings(spin_counts).items()}
    try:
        report(measure(procs, args))
    finally:
        for proc in procs.values():
            proc.kill()


if __name__ == "__main__":
    main()
