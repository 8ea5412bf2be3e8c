"""Routing traces: per token and MoE layer, the top-k expert ids and gate weights of a
generation, tagged by phase, and their JSONL form (schema in docs/routing-trace.md).

Phases of a row (one token at one position of one sequence, as fed to the target):
- "prefill": a prompt token.
- "decode": a token the target sampled, fed back: plain decoding, or the recovered / bonus
  token that opens the next verification window [last, d_1 .. d_K].
- "accepted": a draft token that verification accepted (and that was kept: drafts accepted
  after an earlier stop are "rejected").
- "rejected": a draft token that verification rejected; it is off the sequence, and the
  sequence's token at its position has its own row later.

Capturing a trace from a running engine is `specmoe.analysis.routing_capture`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCHEMA = "specmoe.routing_trace/1"
PHASES = ("prefill", "decode", "accepted", "rejected")
SEQUENCE_PHASES = ("prefill", "decode", "accepted")  # the tokens that are on the sequence


@dataclass(slots=True)
class RoutingTrace:
    """A routing trace, stored by column (R rows, L MoE layers, top_k k).

    Attributes:
        num_experts: N, routed experts per MoE layer.
        top_k: k, experts per token.
        moe_layers: the model's layer index of each of the L MoE layers, in order.
        seq: [R] sequence id of each row (a request id for captured traces).
        pos: [R] int64 position of the token in its sequence (0 = first prompt token).
        token: [R] int64 token id, -1 where unknown (JSON null).
        phase: [R] str, one of PHASES.
        experts: [R, L, k] int64 expert ids, distinct within a row's layer, in [0, N).
        weights: [R, L, k] float32 gate weights, NaN where the row has none.
        model: the model's name or path, or None.

    Raises:
        ValueError: a column of the wrong shape, an unknown phase, an expert id outside
            [0, N), or an expert repeated within a row's layer.
    """

    num_experts: int
    top_k: int
    moe_layers: list[int]
    seq: list[str]
    pos: np.ndarray
    token: np.ndarray
    phase: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    model: str | None = None

    def __post_init__(self) -> None:
        _check_header(self.num_experts, self.top_k, self.moe_layers)
        n, shape = len(self.seq), (len(self.seq), len(self.moe_layers), self.top_k)
        for name, col in (("pos", self.pos), ("token", self.token), ("phase", self.phase)):
            if col.shape != (n,):
                raise ValueError(f"RoutingTrace.{name} has shape {col.shape}, expected ({n},)")
        for name, col in (("experts", self.experts), ("weights", self.weights)):
            if col.shape != shape:
                raise ValueError(f"RoutingTrace.{name} has shape {col.shape}, expected {shape}")
        bad = sorted(set(self.phase.tolist()) - set(PHASES))
        if bad:
            raise ValueError(f"unknown phase {bad[0]!r}: expected one of {PHASES}")
        _check_expert_ids(self.experts, self.num_experts)

    @property
    def num_rows(self) -> int:
        return len(self.seq)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    def header(self) -> dict:
        """The JSONL header object."""
        return {"schema": SCHEMA, "num_experts": self.num_experts, "top_k": self.top_k,
                "moe_layers": list(self.moe_layers), "model": self.model}

    def phase_counts(self) -> dict[str, int]:
        """Rows per phase (every phase listed, 0 when absent)."""
        return {p: int((self.phase == p).sum()) for p in PHASES}


def empty_trace(num_experts: int, top_k: int, moe_layers: Sequence[int],
                model: str | None = None) -> RoutingTrace:
    """A trace with no rows."""
    shape = (0, len(moe_layers), top_k)
    return RoutingTrace(num_experts, top_k, list(moe_layers), [], np.zeros(0, np.int64),
                        np.zeros(0, np.int64), np.zeros(0, "<U8"), np.zeros(shape, np.int64),
                        np.zeros(shape, np.float32), model)


def concat_traces(parts: Sequence[RoutingTrace]) -> RoutingTrace:
    """Rows of `parts` in order, under the first part's header.

    Raises:
        ValueError: no parts, or parts with different N, k or MoE layers.
    """
    if not parts:
        raise ValueError("concat_traces needs at least one trace")
    first = parts[0]
    for p in parts[1:]:
        if (p.num_experts, p.top_k, p.moe_layers) != (first.num_experts, first.top_k,
                                                       first.moe_layers):
            raise ValueError("cannot concatenate traces with different num_experts, top_k "
                             f"or moe_layers: {(p.num_experts, p.top_k, p.moe_layers)} vs "
                             f"{(first.num_experts, first.top_k, first.moe_layers)}")
    return RoutingTrace(first.num_experts, first.top_k, list(first.moe_layers),
                        [s for p in parts for s in p.seq],
                        np.concatenate([p.pos for p in parts]),
                        np.concatenate([p.token for p in parts]),
                        np.concatenate([p.phase for p in parts]).astype("<U8"),
                        np.concatenate([p.experts for p in parts]),
                        np.concatenate([p.weights for p in parts]), first.model)


def _check_header(num_experts: int, top_k: int, moe_layers: Sequence[int]) -> None:
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"invalid num_experts={num_experts!r}: must be an integer >= 1")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"invalid top_k={top_k!r}: must be an integer in [1, {num_experts}]")
    if (not isinstance(moe_layers, (list, tuple)) or not moe_layers
            or not all(_is_int(x) and x >= 0 for x in moe_layers)
            or len(set(moe_layers)) != len(moe_layers)):
        raise ValueError(f"invalid moe_layers={moe_layers!r}: must be a non-empty list of "
                         "distinct layer indices >= 0")


def _check_expert_ids(experts: np.ndarray, num_experts: int) -> None:
    """experts [..., k] integer ids: in [0, N) and distinct along the last axis."""
    if experts.size == 0:
        return
    if experts.dtype.kind not in "iu":
        raise ValueError(f"expert ids must be integers, got dtype {experts.dtype}")
    low, high = int(experts.min()), int(experts.max())
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        raise ValueError(f"expert id {bad} is outside [0, num_experts={num_experts})")
    ordered = np.sort(experts, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("an expert id repeats within one token's top-k")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# --- JSONL ----------------------------------------------------------------------------------


def trace_to_lines(trace: RoutingTrace) -> Iterator[str]:
    """The JSONL lines of `trace` (no newlines): the header, then one object per row.
    Weights are rounded to 6 decimals; a row without weights omits the field."""
    yield json.dumps(trace.header())
    tokens, positions = trace.token.tolist(), trace.pos.tolist()
    weights = np.round(trace.weights.astype(np.float64), 6)
    for i, seq in enumerate(trace.seq):
        row = {"seq": seq, "pos": positions[i], "token": tokens[i] if tokens[i] >= 0 else None,
               "phase": str(trace.phase[i]), "experts": trace.experts[i].tolist()}
        if not np.isnan(weights[i]).all():
            row["weights"] = weights[i].tolist()
        yield json.dumps(row, separators=(",", ":"))


def write_trace(trace: RoutingTrace, path: str | Path) -> Path:
    """Write `trace` as JSONL (docs/routing-trace.md); returns the path.

    Raises:
        FileNotFoundError: the parent directory does not exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write routing trace {path}: directory "
                                f"{path.parent} does not exist")
    with path.open("w", encoding="utf-8") as f:
        for line in trace_to_lines(trace):
            f.write(line + "\n")
    return path


def read_trace(path: str | Path) -> RoutingTrace:
    """Read and validate a JSONL routing trace (docs/routing-trace.md).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON, or a header or row field that is missing or
            invalid (wrong schema, expert id >= num_experts, wrong number of layers or of
            experts per layer, unknown phase, ...); the message names the line and field.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"routing trace {path} is a directory, not a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"routing trace {path} does not exist")
    try:
        with path.open(encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except UnicodeDecodeError as exc:
        raise ValueError(f"routing trace {path} is not UTF-8 text (JSONL): {exc}") from exc


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> RoutingTrace:
    """Parse JSONL lines (header first; blank lines are skipped) into a trace.

    Raises:
        ValueError: as `read_trace`, naming `source`, the line number and the field.
    """
    header, columns = None, _Columns()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        obj = _load_json(line, where)
        if header is None:
            header = _parse_header(obj, where)
        else:
            columns.add(_parse_row(obj, header, where))
    if header is None:
        raise ValueError(f"{source}: empty routing trace (expected a header line with "
                         f"schema {SCHEMA!r})")
    return columns.to_trace(header)


def _load_json(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


@dataclass(slots=True)
class _Header:
    num_experts: int
    top_k: int
    moe_layers: list[int]
    model: str | None


def _parse_header(obj: dict, where: str) -> _Header:
    schema = obj.get("schema")
    if schema != SCHEMA:
        raise ValueError(f"{where}: field 'schema' is {schema!r}, expected {SCHEMA!r} (the "
                         "first line must be the trace header)")
    for name in ("num_experts", "top_k", "moe_layers"):
        if name not in obj:
            raise ValueError(f"{where}: header field {name!r} is missing")
    try:
        _check_header(obj["num_experts"], obj["top_k"], obj["moe_layers"])
    except ValueError as exc:
        raise ValueError(f"{where}: header {exc}") from None
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{where}: header field 'model' must be a string or null, got "
                         f"{model!r}")
    return _Header(obj["num_experts"], obj["top_k"], list(obj["moe_layers"]), model)


@dataclass(slots=True)
class _Row:
    seq: str
    pos: int
    token: int
    phase: str
    experts: np.ndarray  # [L, k] int64
    weights: np.ndarray  # [L, k] float32 (NaN: none)


def _parse_row(obj: dict, h: _Header, where: str) -> _Row:
    for name in ("seq", "pos", "phase", "experts"):
        if name not in obj:
            raise ValueError(f"{where}: field {name!r} is missing")
    seq, pos, token, phase = obj["seq"], obj["pos"], obj.get("token"), obj["phase"]
    if not isinstance(seq, str):
        raise ValueError(f"{where}: field 'seq' must be a string, got {seq!r}")
    if not _is_int(pos) or pos < 0:
        raise ValueError(f"{where}: field 'pos' must be an integer >= 0, got {pos!r}")
    if token is not None and (not _is_int(token) or token < 0):
        raise ValueError(f"{where}: field 'token' must be an integer >= 0 or null, got "
                         f"{token!r}")
    if phase not in PHASES:
        raise ValueError(f"{where}: field 'phase' is {phase!r}, expected one of {PHASES}")
    experts = _parse_matrix(obj["experts"], h, where, "experts", integer=True)
    try:
        _check_expert_ids(experts, h.num_experts)
    except ValueError as exc:
        raise ValueError(f"{where}: field 'experts': {exc}") from None
    weights = obj.get("weights")
    weights = (np.full(experts.shape, np.nan, np.float32) if weights is None else
               _parse_matrix(weights, h, where, "weights", integer=False).astype(np.float32))
    return _Row(seq, pos, -1 if token is None else token, phase, experts, weights)


def _parse_matrix(value, h: _Header, where: str, field: str, integer: bool) -> np.ndarray:
    """[L, k] from a list of L lists of k numbers (ints when `integer`)."""
    num_layers, k = len(h.moe_layers), h.top_k
    expected = f"{num_layers} lists (one per MoE layer) of {k} " + (
        "expert ids" if integer else "gate weights")
    if not isinstance(value, list) or len(value) != num_layers:
        got = f"{len(value)} entries" if isinstance(value, list) else repr(value)
        raise ValueError(f"{where}: field {field!r} must hold {expected}, got {got}")
    for layer, entry in enumerate(value):
        if not isinstance(entry, list) or len(entry) != k:
            raise ValueError(f"{where}: field {field!r}, MoE layer {layer}: expected {k} "
                             f"values (top_k={k}), got {entry!r}")
        ok = _is_int if integer else _is_finite_number
        bad = [x for x in entry if not ok(x)]
        if bad:
            kind = "an integer" if integer else "a finite number"
            raise ValueError(f"{where}: field {field!r}, MoE layer {layer}: {bad[0]!r} is "
                             f"not {kind}")
    return np.asarray(value, dtype=np.int64 if integer else np.float64)


def _is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _Columns:
    """Rows gathered while parsing."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []

    def add(self, row: _Row) -> None:
        self.rows.append(row)

    def to_trace(self, h: _Header) -> RoutingTrace:
        if not self.rows:
            return empty_trace(h.num_experts, h.top_k, h.moe_layers, h.model)
        r = self.rows
        return RoutingTrace(h.num_experts, h.top_k, h.moe_layers, [x.seq for x in r],
                            np.array([x.pos for x in r], np.int64),
                            np.array([x.token for x in r], np.int64),
                            np.array([x.phase for x in r], "<U8"),
                            np.stack([x.experts for x in r]), np.stack([x.weights for x in r]),
                            h.model)
