"""`killick ctl`: talk to a running server - stats, and cache resizing without a restart."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

DEFAULT_SERVER = "http://127.0.0.1:8421"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"killick server URL (default {DEFAULT_SERVER})")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    sub = p.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    s = sub.add_parser("stats", help="engine, prefix-cache, expert-cache and per-turn figures")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    c = sub.add_parser("cache", help="resize caches at the next safe point (no restart, no reload)")
    c.add_argument("--moe", type=int, metavar="N", help="device expert slots (offload/cpu/hybrid backends)")
    c.add_argument("--kv", type=int, metavar="TOKENS", help="KV budget: tokens one request may hold")
    c.add_argument("--prefix-device-mb", type=int, metavar="MB", help="prefix cache budget on the device")
    c.add_argument("--prefix-host-mb", type=int, metavar="MB", help="prefix cache budget in host RAM")


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
    req = urllib.request.Request(args.server.rstrip("/") + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", {})
        message = detail.get("message", exc.reason) if isinstance(detail, dict) else detail
        raise ValueError(f"server refused ({exc.code}): {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"no killick server at {args.server} ({exc}); start one with `killick serve` "
                         f"or pass --server URL") from None


def _render_stats(data: dict) -> str:
    engine, lines = data.get("engine", {}), []
    for key in ("active", "queued", "requests", "finished", "aborted", "errors", "prompt_tokens",
                "reused_tokens", "prefilled_tokens", "output_tokens", "shared_prefill_waits",
                "shared_prefill_tokens", "context_length"):
        if key in engine:
            lines.append(f"{key:<28}{engine[key]}")
    for key, value in sorted(engine.items()):
        if key.startswith("cache_"):
            lines.append(f"{key:<28}{value}")
    experts = engine.get("experts", {})
    if isinstance(experts, dict) and "total" in experts:
        lines.append(f"{'experts backend':<28}{experts.get('backend')} ({experts.get('slots')} slots)")
        lines += [f"  experts {k:<19}{v}" for k, v in experts["total"].items()]
    for key, value in (data.get("policy") or {}).items():
        lines.append(f"policy {key:<21}{json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return "\n".join(lines)
