"""Where requests' time goes, from the spans deployments/tracing.py exported.

    python -m deployments.where_time_goes traces/spans.jsonl [more files or dirs] [--out FILE.png]
        [--request ID] [--max-requests N]

Prints, per request and over all requests, the time in queue, prefill, handoff (disaggregated
mode: the KV's transfer from the prefill pool), draft, verify (target forward), sampling, other
engine work (scheduling, input preparation, commit) and serving overhead (the rest of the request
span: gaps between engine steps, output delivery), then the acceptance of each verification step.
A request prefilled by the prefill pool is one `specdecode.disaggregated` span holding the prefill
replica's request, the handoff and the decode replica's request: its steps are both engines'.
Writes a PNG: stacked bars per request and the timeline of one request's steps. Reads the file
exporter's JSON lines and OTLP/JSON lines (an OpenTelemetry Collector's file exporter). A step serving several requests counts in full for each: it is time each one waited.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments import tracing as t

CATEGORIES = ("queue", "prefill", "handoff", "draft", "tree_draft", "verify", "tree_verify", "sample", "engine_other",
              "overhead")
COLORS = {
    "queue": "#9e9e9e", "prefill": "#6a3d9a", "handoff": "#fb9a99", "draft": "#33a02c", "verify": "#1f78b4",
    "tree_draft": "#b2df8a", "tree_verify": "#a6cee3",
    "sample": "#ff7f00", "engine_other": "#b15928", "overhead": "#e31a1c",
}


@dataclass
class SpanRecord:
    """One finished span, whichever file format it came from."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class StepShare:
    """One engine step as one request saw it. `start_s` is relative to the request's start."""

    index: int
    kind: str  # prefill | decode | handoff (disaggregated: the transfer; no engine step)
    start_s: float
    duration_s: float
    draft_s: float
    verify_s: float
    sample_s: float
    other_s: float
    num_drafted: int
    num_accepted: int
    num_requests: int
    share: float
    tree_depth: int = 0  # this step verified a token tree of this depth for the request (0: none or a chain)
    tree_drafts: bool = False  # the step's drafting (draft_s) made token trees


@dataclass
class RequestBreakdown:
    """A request's wall time split into CATEGORIES (seconds), with its steps."""

    request_id: str
    trace_id: str
    start_ns: int
    wall_s: float
    parts: dict[str, float]
    steps: list[StepShare]
    num_output_tokens: int | None = None
    ttft_s: float | None = None

    @property
    def verifications(self) -> list[tuple[int, int]]:
        """(drafted, accepted) of each step that verified drafts for this request."""
        return [(s.num_drafted, s.num_accepted) for s in self.steps if s.num_drafted]

    @property
    def num_steps(self) -> int:
        """Engine steps that served it (both engines' in disaggregated mode)."""
        return sum(1 for s in self.steps if s.kind != "handoff")

    @property
    def accounted_s(self) -> float:
        return sum(self.parts.values())


# --- reading -------------------------------------------------------------------------------------
def iter_files(paths: Iterable[str | os.PathLike]) -> Iterator[Path]:
    """The files named, and the *.jsonl / *.json files under the directories named."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json") and p.is_file())
        elif path.is_file():
            yield path
        else:
            raise FileNotFoundError(f"no spans file or directory at {path}")


def load_spans(paths: Iterable[str | os.PathLike]) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    for path in iter_files(paths):
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
                if "resourceSpans" in obj:
                    spans.extend(_from_otlp_json(obj))
                else:
                    spans.append(_from_line(obj))
    return spans


def _from_line(obj: dict) -> SpanRecord:
    return SpanRecord(
        name=obj["name"], trace_id=obj["trace_id"], span_id=obj["span_id"], parent_span_id=obj.get("parent_span_id"),
        start_ns=int(obj["start_time_unix_nano"]), end_ns=int(obj["end_time_unix_nano"]),
        attributes=obj.get("attributes") or {}, events=obj.get("events") or [],
    )


def _otlp_value(value: dict) -> Any:
    """An OTLP/JSON AnyValue: {"stringValue": "x"}, {"intValue": "3"}, {"arrayValue": {...}}, ..."""
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    for key in ("stringValue", "boolValue"):
        if key in value:
            return value[key]
    return None


def _from_otlp_json(obj: dict) -> Iterator[SpanRecord]:
    for resource_spans in obj.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for s in scope_spans.get("spans", []):
                yield SpanRecord(
                    name=s["name"], trace_id=s["traceId"].lower(), span_id=s["spanId"].lower(),
                    parent_span_id=(s.get("parentSpanId") or "").lower() or None,
                    start_ns=int(s["startTimeUnixNano"]), end_ns=int(s["endTimeUnixNano"]),
                    attributes={a["key"]: _otlp_value(a["value"]) for a in s.get("attributes", [])},
                    events=[{"name": e.get("name"), "time_unix_nano": int(e.get("timeUnixNano", 0))}
                            for e in s.get("events", [])],
                )


# --- analysis ------------------------------------------------------------------------------------
def breakdowns(spans: list[SpanRecord]) -> list[RequestBreakdown]:
    """One breakdown per request, in order of arrival: each `specdecode.request` span, except
    those inside a `specdecode.disaggregated` span, which is one request of its own."""
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        if s.parent_span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    disaggregated = {s.span_id for s in spans if s.name == t.DISAGG_SPAN}
    tops = [s for s in spans if s.name == t.DISAGG_SPAN
            or (s.name == t.REQUEST_SPAN and s.parent_span_id not in disaggregated)]
    out = []
    for top in sorted(tops, key=lambda s: s.start_ns):
        parts = dict.fromkeys(CATEGORIES, 0.0)
        steps: list[StepShare] = []
        ttft_s = top.attributes.get(t.ATTR_TTFT_S)
        num_output_tokens = top.attributes.get(t.ATTR_NUM_OUTPUT_TOKENS)
        if top.name == t.REQUEST_SPAN:
            _add_request(top, top.start_ns, children, parts, steps)
        else:
            for c in sorted(children.get(top.span_id, []), key=lambda s: s.start_ns):
                if c.name == t.REQUEST_SPAN:
                    _add_request(c, top.start_ns, children, parts, steps)
                    a = c.attributes
                    if a.get(t.ATTR_ROLE) == "prefill" and a.get(t.ATTR_TTFT_S) is not None:
                        ttft_s = (c.start_ns - top.start_ns) / 1e9 + float(a[t.ATTR_TTFT_S])
                    if a.get(t.ATTR_ROLE) == "decode" and a.get(t.ATTR_NUM_OUTPUT_TOKENS) is not None:
                        num_output_tokens = a[t.ATTR_NUM_OUTPUT_TOKENS]
                elif c.name == t.HANDOFF_SPAN:
                    parts["handoff"] += c.duration_s
                    steps.append(StepShare(index=-1, kind="handoff", start_s=(c.start_ns - top.start_ns) / 1e9,
                                           duration_s=c.duration_s, draft_s=0.0, verify_s=0.0, sample_s=0.0,
                                           other_s=0.0, num_drafted=0, num_accepted=0, num_requests=1, share=1.0))
            steps.sort(key=lambda s: s.start_s)
        wall = top.duration_s
        parts["overhead"] = max(0.0, wall - sum(parts.values()))
        out.append(RequestBreakdown(
            request_id=str(top.attributes.get(t.ATTR_REQUEST_ID, top.span_id)), trace_id=top.trace_id,
            start_ns=top.start_ns, wall_s=wall, parts=parts, steps=steps,
            num_output_tokens=num_output_tokens, ttft_s=ttft_s,
        ))
    return out


def _add_request(req: SpanRecord, origin_ns: int, children: dict[str, list[SpanRecord]],
                 parts: dict[str, float], steps: list[StepShare]) -> None:
    """Add one engine request's queue and step spans to `parts` and `steps` (times from `origin_ns`)."""
    for c in sorted(children.get(req.span_id, []), key=lambda s: s.start_ns):
        a = c.attributes
        if c.name == t.QUEUE_SPAN:
            parts["queue"] += c.duration_s
        elif c.name in (t.PREFILL_SPAN, t.DECODE_SPAN):
            step = StepShare(
                index=int(a.get(t.ATTR_STEP_INDEX, -1)),
                kind="prefill" if c.name == t.PREFILL_SPAN else "decode",
                start_s=(c.start_ns - origin_ns) / 1e9, duration_s=c.duration_s,
                draft_s=float(a.get(t.ATTR_DRAFT_S, 0.0)), verify_s=float(a.get(t.ATTR_VERIFY_S, 0.0)),
                sample_s=float(a.get(t.ATTR_SAMPLE_S, 0.0)), other_s=float(a.get(t.ATTR_OTHER_S, 0.0)),
                num_drafted=int(a.get(t.ATTR_NUM_DRAFTED, 0)), num_accepted=int(a.get(t.ATTR_NUM_ACCEPTED, 0)),
                num_requests=int(a.get(t.ATTR_STEP_NUM_REQUESTS, 1)), share=float(a.get(t.ATTR_SHARE, 1.0)),
                tree_depth=int(a.get(t.ATTR_TREE_DEPTH, 0)), tree_drafts=int(a.get(t.ATTR_STEP_NUM_TREE_DRAFTS, 0)) > 0,
            )
            steps.append(step)
            if step.kind == "prefill":
                parts["prefill"] += step.duration_s
            else:
                # The four phases split the step's interval; scale them onto the span's
                # duration so rounding never leaves a sliver unaccounted.
                phases = step.draft_s + step.verify_s + step.sample_s + step.other_s
                scale = step.duration_s / phases if phases > 0 else 0.0
                parts["tree_draft" if step.tree_drafts else "draft"] += step.draft_s * scale
                parts["tree_verify" if step.tree_depth else "verify"] += step.verify_s * scale
                parts["sample"] += step.sample_s * scale
                parts["engine_other"] += step.other_s * scale


def acceptance_summary(bds: list[RequestBreakdown]) -> dict[str, Any]:
    """Acceptance over all verification steps: rate, mean accepted length, by position, histogram."""
    checks = [v for b in bds for v in b.verifications]
    drafted = sum(d for d, _ in checks)
    accepted = sum(a for _, a in checks)
    k = max((d for d, _ in checks), default=0)
    by_position = []
    for i in range(k):
        n_drafted = sum(1 for d, _ in checks if d > i)
        by_position.append(sum(1 for _, a in checks if a > i) / n_drafted if n_drafted else 0.0)
    return {
        "num_verify_steps": len(checks),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + len(checks)) / len(checks) if checks else 0.0,
        "acceptance_by_position": by_position,
        "accepted_histogram": dict(sorted(Counter(a for _, a in checks).items())),
    }


# --- report --------------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f}"


def format_report(bds: list[RequestBreakdown], max_requests: int = 50) -> str:
    if not bds:
        return f"no `{t.REQUEST_SPAN}` spans found: was tracing on, and has the exporter flushed?"
    head = f"{'request':<24}{'wall ms':>9}" + "".join(f"{c:>13}" for c in CATEGORIES) + f"{'steps':>7}{'acc/drft':>10}"
    lines = [f"{len(bds)} requests (ms; a step serving several requests counts for each)", head]
    for b in bds[:max_requests]:
        v = b.verifications
        acc = f"{sum(a for _, a in v)}/{sum(d for d, _ in v)}" if v else "-"
        lines.append(f"{b.request_id[:23]:<24}{_ms(b.wall_s)}" + "".join(f"{_ms(b.parts[c]):>13}" for c in CATEGORIES)
                     + f"{b.num_steps:>7}{acc:>10}")
    if len(bds) > max_requests:
        lines.append(f"... {len(bds) - max_requests} more requests")
    total_wall = sum(b.wall_s for b in bds)
    totals = {c: sum(b.parts[c] for b in bds) for c in CATEGORIES}
    lines.append("")
    lines.append(f"over all requests: wall {total_wall * 1e3:.2f} ms, mean {total_wall / len(bds) * 1e3:.2f} ms per request")
    for c in CATEGORIES:
        share = totals[c] / total_wall if total_wall else 0.0
        lines.append(f"  {c:<13}{totals[c] * 1e3:12.2f} ms  {share:6.1%}  mean {totals[c] / len(bds) * 1e3:9.2f} ms")
    s = acceptance_summary(bds)
    lines.append("")
    if s["num_verify_steps"]:
        lines.append(
            f"acceptance: {s['num_accepted_tokens']}/{s['num_draft_tokens']} draft tokens "
            f"({s['acceptance_rate']:.1%}) over {s['num_verify_steps']} verification steps, "
            f"mean accepted length {s['mean_accepted_length']:.2f} tokens per step"
        )
        lines.append("  by position: " + " ".join(f"{i}:{r:.0%}" for i, r in enumerate(s["acceptance_by_position"])))
        lines.append("  steps by tokens accepted: " + ", ".join(f"{a}: {n}" for a, n in s["accepted_histogram"].items()))
        lines.append("acceptance per verification step (accepted/drafted):")
        for b in bds[:max_requests]:
            if b.verifications:
                lines.append(f"  {b.request_id[:23]:<24}" + " ".join(f"{a}/{d}" for d, a in b.verifications))
    else:
        lines.append("acceptance: no verification steps (speculation off)")
    return "\n".join(lines)


def pick_request(bds: list[RequestBreakdown], request_id: str | None) -> RequestBreakdown:
    """The named request, else the one with the most verification steps (then the longest)."""
    if request_id is not None:
        for b in bds:
            if b.request_id == request_id:
                return b
        raise ValueError(f"no request {request_id!r} in the spans; have: {', '.join(b.request_id for b in bds[:10])}")
    return max(bds, key=lambda b: (len(b.verifications), b.wall_s))


def plot(bds: list[RequestBreakdown], out_path: str | os.PathLike, request_id: str | None = None,
         max_requests: int = 50) -> RequestBreakdown:
    """Write the PNG: stacked bars per request (top), one request's step timeline (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = bds[:max_requests]
    chosen = pick_request(bds, request_id)
    fig, (bars, timeline) = plt.subplots(2, 1, figsize=(max(8.0, 0.35 * len(shown) + 4), 8.5),
                                         gridspec_kw={"height_ratios": [3, 2]})
    x = range(len(shown))
    bottom = [0.0] * len(shown)
    for c in CATEGORIES:
        heights = [b.parts[c] * 1e3 for b in shown]
        bars.bar(x, heights, bottom=bottom, color=COLORS[c], label=c, width=0.8)
        bottom = [lo + h for lo, h in zip(bottom, heights, strict=True)]
    bars.set_xticks(list(x), [b.request_id[:12] for b in shown], rotation=60, ha="right", fontsize=7)
    bars.set_ylabel("ms")
    bars.set_title("Where each request's time goes")
    bars.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    # Timeline: queue, then each step. Within a decode step the phase order is schematic (other
    # work is scheduling before and commit after the forward); drafting is really at its end.
    y, height = 0.0, 0.6
    queue = [(0.0, chosen.steps[0].start_s)] if chosen.steps and chosen.steps[0].kind != "handoff" else []
    timeline.broken_barh([(a * 1e3, w * 1e3) for a, w in queue], (y, height), color=COLORS["queue"])
    for s in chosen.steps:
        start = s.start_s * 1e3
        if s.kind in ("prefill", "handoff"):
            segments = [(s.kind, s.duration_s)]
        else:
            phases = s.draft_s + s.verify_s + s.sample_s + s.other_s
            scale = s.duration_s / phases if phases > 0 else 0.0
            segments = [("engine_other", s.other_s * scale), ("tree_verify" if s.tree_depth else "verify", s.verify_s * scale),
                        ("sample", s.sample_s * scale), ("tree_draft" if s.tree_drafts else "draft", s.draft_s * scale)]
        for name, width in segments:
            timeline.broken_barh([(start, width * 1e3)], (y, height), color=COLORS[name])
            start += width * 1e3
        if s.num_drafted:
            timeline.text((s.start_s + s.duration_s / 2) * 1e3, y + height + 0.05, f"{s.num_accepted}/{s.num_drafted}",
                          ha="center", va="bottom", fontsize=6, rotation=90)
    timeline.set_xlim(0, chosen.wall_s * 1e3)
    timeline.set_ylim(-0.2, 1.6)
    timeline.set_yticks([])
    timeline.set_xlabel("ms since the request started (gaps: serving overhead; labels: accepted/drafted)")
    timeline.set_title(f"Request {chosen.request_id}: {chosen.num_steps} steps, "
                       f"{len(chosen.verifications)} verifications, wall {chosen.wall_s * 1e3:.1f} ms")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Where requests' time goes, from deployments/tracing.py spans.")
    p.add_argument("paths", nargs="+", help="spans files (JSON lines) or directories of them")
    p.add_argument("--out", default=None, help="PNG to write (default: where_time_goes.png beside the first file)")
    p.add_argument("--request", default=None, help="request id for the timeline (default: most verifications)")
    p.add_argument("--max-requests", type=int, default=50, help="requests listed and plotted (default 50)")
    args = p.parse_args(argv)
    try:
        bds = breakdowns(load_spans(args.paths))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(bds, args.max_requests))
    if not bds:
        return 1
    first = Path(args.paths[0])
    out = args.out or str((first if first.is_dir() else first.parent) / "where_time_goes.png")
    try:
        chosen = plot(bds, out, args.request, args.max_requests)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\nwrote {out} (timeline: request {chosen.request_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
