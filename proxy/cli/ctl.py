"""`killick ctl`: talk to a running server - stats, and cache resizing without a restart."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

from proxy.cli import KEY_ENV, URL_FORMS, api_key, server_url

DEFAULT_SERVER = "http://127.0.0.1:8421"


def add_arguments(p: argparse.ArgumentParser) -> None:
    _server_arguments(p, DEFAULT_SERVER, None)
    sub = p.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    s = sub.add_parser("stats", help="engine, prefix-cache, expert-cache and per-turn figures")
    _server_arguments(s, argparse.SUPPRESS, argparse.SUPPRESS)  # before or after the action
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    c = sub.add_parser("cache", help="resize caches at the next safe point (no restart, no reload)")
    _server_arguments(c, argparse.SUPPRESS, argparse.SUPPRESS)
    c.add_argument("--moe", type=size_arg, metavar="N", help="device expert slots (offload/cpu/hybrid backends)")
    c.add_argument("--kv", type=size_arg, metavar="TOKENS", help="KV budget: tokens one request may hold")
    c.add_argument("--prefix-device-mb", type=size_arg, metavar="MB", help="prefix cache budget on the device")
    c.add_argument("--prefix-host-mb", type=size_arg, metavar="MB", help="prefix cache budget in host RAM")


def size_arg(text: str) -> int:
    """A size the server's cache endpoint takes, checked before it is asked."""
    from proxy.apis.control import MAX_SIZE

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {MAX_SIZE}, got {text!r}")
    return value


def _server_arguments(p: argparse.ArgumentParser, server, key) -> None:
    p.add_argument("--server", default=server, help=f"killick server URL (default {DEFAULT_SERVER}; {URL_FORMS})")
    p.add_argument("--api-key", default=key, help=f"the server's --api-key, if it has one (default: ${KEY_ENV})")


def run(args: argparse.Namespace) -> int:
    if args.ctl_command == "stats":
        data = _call(args, "GET", "/v1/killick/stats")
        print(json.dumps(data, indent=2) if args.json else _render_stats(data))
        return 0
    body = {k: v for k, v in (("moe_slots", args.moe), ("kv_tokens", args.kv),
                              ("prefix_device_mb", args.prefix_device_mb),
                              ("prefix_host_mb", args.prefix_host_mb)) if v is not None}
    if not body:
        raise ValueError("nothing to change: pass --moe N, --kv TOKENS, --prefix-device-mb or --prefix-host-mb")
    data = _call(args, "POST", "/v1/killick/cache", body)
    print(_render_stats({"engine": data["engine"], "policy": {}}))
    return 0


def _call(args, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(server_url(args.server, "--server") + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    key = api_key(args)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except json.JSONDecodeError:
        raise ValueError(f"{args.server} answered {path} with something other than JSON: is it a killick "
                         "server? (pass --server URL)") from None
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read() or b"{}").get("error", {})
        except (ValueError, AttributeError):  # not a killick error body
            detail = {}
        message = detail.get("message", exc.reason) if isinstance(detail, dict) else detail
        raise ValueError(f"server refused ({exc.code}): {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"no killick server at {args.server} ({exc}); start one with `killick serve` "
                         f"or pass --server URL") from None


ENGINE_KEYS = ("active", "queued", "requests", "finished", "aborted", "errors", "prompt_tokens", "reused_tokens",
               "prefilled_tokens", "output_tokens", "shared_prefill_waits", "shared_prefill_tokens", "context_length")
TURN_COLUMNS = ("session", "turn", "kind", "prompt", "edit_point", "edit_class", "resume_at", "cached", "prefilled",
                "ttft_ms")


def _render_stats(data: dict) -> str:
    """Totals as `name  value` lines, then the last turns of each session as a table."""
    engine = data.get("engine", {})
    pairs = [(k, engine[k]) for k in ENGINE_KEYS if k in engine]
    pairs += sorted((k, v) for k, v in engine.items() if k.startswith("cache_"))
    experts = engine.get("experts", {})
    if isinstance(experts, dict) and "total" in experts:
        slots = experts.get("slots")
        pairs.append(("experts backend", f"{experts.get('backend')}" + (f" ({slots} slots)" if slots else "")))
        pairs += [(f"  experts {k}", v) for k, v in experts["total"].items()]
    policy = dict(data.get("policy") or {})
    turns = policy.pop("recent_turns", [])
    pairs += [(f"policy {k}", _flat(v)) for k, v in policy.items()]
    width = max((len(k) for k, _ in pairs), default=0) + 2
    lines = [f"{k:<{width}}{v}" for k, v in pairs]
    if turns:
        lines += ["", "last turns of each session", _table(turns)]
    return "\n".join(lines + _upstream_lines(engine))


def _flat(value) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


def _table(turns: list[dict]) -> str:
    rows = [TURN_COLUMNS] + [tuple("-" if t.get(c) is None else str(t.get(c)) for c in TURN_COLUMNS) for t in turns]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TURN_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


REPLICA_COLUMNS = ("url", "healthy", "in_flight", "requests", "failures", "sessions", "prompt_tokens",
                   "cached_tokens", "reasoning")
SESSION_COLUMNS = ("session", "replica", "turns", "moves", "prompt_tokens", "cached_tokens", "last_prompt_tokens",
                   "last_cached_tokens")


def _upstream_lines(engine: dict) -> list[str]:
    """Upstream mode: the replicas with the totals of failures and retries (a request sent to another replica
    after one failed), and how much of each session's prompts its replica reused."""
    if not isinstance(engine.get("replicas"), list):
        return []
    totals = ", ".join(f"{k.replace('_', ' ')} {engine[k]}" for k in ("failures", "retries", "session_moves")
                       if k in engine)
    lines = ["", f"upstream replicas (routing {engine.get('routing')}): {engine.get('replicas_up')} of "
                 f"{engine.get('replicas_total')} up, {totals}"]
    reasoning = engine.get("reasoning") or {}  # where each replica sends the thinking (--upstream-reasoning)
    lines.append(_columns([{**r, "reasoning": reasoning.get(r.get("url"), "-")} for r in engine["replicas"]],
                          REPLICA_COLUMNS))
    lines += [f"  {url}: {why}" for url, why in (engine.get("last_errors") or {}).items()]
    if engine.get("recent_sessions"):
        lines += ["", "sessions (most recent first)", _columns(engine["recent_sessions"], SESSION_COLUMNS)]
    return lines


def _columns(records: list[dict], columns: tuple[str, ...]) -> str:
    rows = [columns] + [tuple(str(r.get(c, "-")) for c in columns) for r in records]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
