"""Prometheus text exposition (format 0.0.4) of the proxy's counters and the engine's own figures.

Counters and histograms are kept here; engine figures (active, queued, cache hits, bytes...) come from
`core.stats()` at scrape time and are exported as gauges `killick_engine_<key>`; the cache policy's
(sessions, turns per edit class) as `killick_policy_<key>`. A list of records in the core's stats (upstream
mode's replicas and sessions) becomes labelled gauges: `killick_engine_<list>_<field>{<text fields>}`.
"""
from __future__ import annotations

import math
import re
from collections import Counter

from engine.api import Usage

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 400)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b:g}"}} {n}' for b, n in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total:g}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (api, status) -> requests
        self.tokens: Counter[str] = Counter()  # prompt / cached / prefilled / output
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode_rate = Histogram(RATE_BUCKETS)
        self.queue = Histogram(TTFT_BUCKETS)
        self.prepare = Histogram(TTFT_BUCKETS)
        self.first_token = Histogram(TTFT_BUCKETS)
        self.first_output = Histogram(TTFT_BUCKETS)

    def request_done(self, api: str, status: int) -> None:
        self.requests[(api, status)] += 1

    def observe_usage(self, usage: Usage) -> None:
        self.tokens["prompt"] += usage.prompt_tokens
        self.tokens["cached"] += usage.reused_tokens
        self.tokens["prefilled"] += usage.prefilled_tokens
        self.tokens["output"] += usage.output_tokens
        if usage.output_tokens > 0:
            self.ttft.observe(usage.ttft_s)
        if usage.decode_tok_s > 0:
            self.decode_rate.observe(usage.decode_tok_s)
        self.queue.observe(usage.queue_s)

    def observe_turn(self, *, prepare_s: float | None, first_token_s: float | None,
                     first_output_s: float | None) -> None:
        """A generating request's own times since it arrived, in the order they come (proxy.generation.Turn);
        None: not reached."""
        if prepare_s is not None:
            self.prepare.observe(prepare_s)
        if first_token_s is not None:
            self.first_token.observe(first_token_s)
        if first_output_s is not None:
            self.first_output.observe(first_output_s)

    def render(self, engine_stats: dict, policy_stats: dict | None = None) -> str:
        out = ["# HELP killick_requests_total Finished API requests by API and HTTP status.",
               "# TYPE killick_requests_total counter"]
        out += [f'killick_requests_total{{api="{api}",status="{status}"}} {n}'
                for (api, status), n in sorted(self.requests.items())]
        out += ["# HELP killick_tokens_total Tokens by kind: prompt, cached (reused), prefilled, output.",
                "# TYPE killick_tokens_total counter"]
        out += [f'killick_tokens_total{{kind="{kind}"}} {self.tokens[kind]}'
                for kind in ("prompt", "cached", "prefilled", "output")]
        out += self.ttft.lines("killick_ttft_seconds", "Time from submit to the first output token.")
        out += self.decode_rate.lines("killick_decode_tokens_per_second", "Decode rate per request.")
        out += self.queue.lines("killick_queue_seconds", "Time from submit to first scheduled.")
        out += self.prepare.lines("killick_prepare_seconds", "Time from arrival to submit: read, normalise, render, "
                                  "tokenize, plan.")
        out += self.first_token.lines("killick_first_token_seconds", "Time from arrival to the engine's first "
                                      "output token reaching the proxy.")
        out += self.first_output.lines("killick_first_output_seconds", "Time from arrival to the first output "
                                       "event (past the detokenizer's and output parser's hold-back).")
        for prefix, stats in (("killick_engine_", engine_stats), ("killick_policy_", policy_stats or {})):
            for key, value in sorted(_flatten(stats).items()):
                out += [f"# TYPE {prefix}{key} gauge", f"{prefix}{key} {value:g}"]
        out += _record_lines("killick_engine_", engine_stats)
        return "\n".join(out) + "\n"


def _record_lines(prefix: str, stats: dict) -> list[str]:
    """Each list of dicts in stats: one gauge per numeric field, labelled by the record's text fields."""
    out = []
    for key, records in sorted(stats.items()):
        if not (isinstance(records, list) and records and all(isinstance(r, dict) for r in records)):
            continue
        fields = sorted({k for r in records for k, v in r.items() if _is_number(v)})
        for name in fields:
            metric = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{key}_{name}")
            out.append(f"# TYPE {metric} gauge")
            for r in records:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(r.items()) if isinstance(v, str))
                if _is_number(r.get(name)):
                    out.append(f"{metric}{{{labels}}} {float(r[name]):g}")
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _flatten(stats: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested stats dict, keys joined with '_' and made Prometheus-safe."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{key}")
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "_"))
        elif _is_number(value):
            flat[name] = float(value)
    return flat
