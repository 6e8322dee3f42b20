"""Tables, summary, JSON and the TTFT plot for `killick replay`. Torch-free; matplotlib only for --plot."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from proxy.replay.client import Result

COLUMNS = ("turn", "api", "ttft_ms", "prompt", "cached", "shared", "prefilled", "out", "dec_tok_s", "edit", "class")


def _row(r: Result) -> tuple:
    ttft = f"{r.ttft_s * 1000:.0f}" + ("*" if r.ttft_kind == "total" else "")
    return (r.turn, r.path.rsplit("/", 1)[-1], ttft if r.status == 200 else f"HTTP {r.status}", r.prompt_tokens,
            r.cached_tokens, "-" if r.shared_tokens is None else r.shared_tokens, r.prefilled_tokens,
            r.output_tokens, f"{r.decode_tok_s:.1f}", "" if r.edit_point is None else r.edit_point,
            r.edit_class or "")


def text_table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(map(str, header))] + [tuple(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def session_tables(mode: str, results: list[Result]) -> str:
    out = []
    for session in dict.fromkeys(r.session for r in results):
        rows = [_row(r) for r in results if r.session == session]
        out.append(f"[{mode}] session {session} ({len(rows)} requests)\n" + text_table(rows, COLUMNS))
    if any(r.ttft_kind == "total" for r in results):
        out.append("* non-streaming request: TTFT is the total request time")
    return "\n\n".join(out)


def later_turns(results: list[Result]) -> list[Result]:
    """Turns >= 2 of each session that succeeded: the ones a prefix cache can help."""
    return [r for r in results if r.turn >= 2 and r.status == 200]


ENGINE_COUNTERS = ("prefilled_tokens", "reused_tokens", "shared_prefill_waits", "shared_prefill_tokens")


def summary(by_mode: dict[str, list[Result]]) -> dict:
    out = {}
    for mode, results in by_mode.items():
        later = later_turns(results)
        engine = getattr(results, "engine", {})
        out[mode] = {
            "requests": len(results), "failed": sum(r.status != 200 for r in results),
            "wall_s": round(getattr(results, "wall_s", 0.0), 3),
            "engine": {k: engine[k] for k in ENGINE_COUNTERS if k in engine},
            "median_ttft_s_turn1": _median([r.ttft_s for r in results if r.turn == 1 and r.status == 200]),
            "median_ttft_s_later": _median([r.ttft_s for r in later]),
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "cached_tokens": sum(r.cached_tokens for r in results),
            "shared_tokens": sum(r.shared_tokens or 0 for r in results),
            "prefilled_tokens": sum(r.prefilled_tokens for r in results),
        }
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summary_text(by_mode: dict[str, list[Result]]) -> str:
    s = summary(by_mode)
    rows = [(m, v["requests"], v["failed"], ms(v["median_ttft_s_turn1"]), ms(v["median_ttft_s_later"]),
             ms(v["wall_s"]), v["prompt_tokens"], v["cached_tokens"], v["shared_tokens"], v["prefilled_tokens"])
            for m, v in s.items()]
    head = ("mode", "requests", "failed", "ttft_turn1_ms", "ttft_later_ms", "wall_ms", "prompt", "cached", "shared",
            "prefilled")
    text = "summary (median TTFT; later = turns >= 2 of each session; wall = first send to last answer)\n"
    text += text_table(rows, head)
    engines = [(m, *(v["engine"].get(k, "-") for k in ENGINE_COUNTERS)) for m, v in s.items() if v["engine"]]
    if engines:
        text += "\n\nengine counters during the replay\n" + text_table(engines, ("mode", *ENGINE_COUNTERS))
    return text


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def ttft_table(by_mode: dict[str, list[Result]]) -> str:
    """TTFT per request, one column per mode (the requests are the same in every mode)."""
    modes = list(by_mode)
    first = by_mode[modes[0]]
    rows = []
    for i, r in enumerate(first):
        row = [r.index + 1, r.session[-18:], r.turn, r.prompt_tokens]  # (a qualified session ends in its key)
        row += [ms(by_mode[m][i].ttft_s) if i < len(by_mode[m]) else "-" for m in modes]
        rows.append(tuple(row))
    return "TTFT per turn (ms)\n" + text_table(rows, ("req", "session", "turn", "prompt", *modes))


def write_json(path: str | Path, by_mode: dict[str, list[Result]], meta: dict) -> None:
    data = {"meta": meta, "summary": summary(by_mode),
            "results": {m: [r.to_json() for r in rs] for m, rs in by_mode.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))


def check_plot() -> None:
    """Refuse --plot before a replay runs, not after it, where matplotlib is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")


def plot(path: str | Path, by_mode: dict[str, list[Result]], title: str = "TTFT per turn") -> None:
    """One line per mode: TTFT of each request in replay order (log scale)."""
    check_plot()
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache INFO line is not ours to print
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for mode, results in by_mode.items():
        ax.plot([r.index + 1 for r in results], [max(r.ttft_s, 1e-4) for r in results], marker="o", label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("request (replay order)")
    ax.set_ylabel("TTFT (s, client side)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
