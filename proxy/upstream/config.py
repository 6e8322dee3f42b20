"""Upstream mode's settings: the replicas, the model-name map, routing, health checks, timeouts. Torch-free.

From the command line (`killick serve --upstream URL ... --upstream-model 'claude-*=qwen3.6'`) or from a file
(`--upstream-config FILE`, TOML or JSON; flags given on the command line win):

    upstreams = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    routing = "session"              # or "round-robin"
    health_interval = 5.0            # seconds between health checks (GET /health)
    connect_timeout = 5.0
    read_timeout = 600.0             # longest silence inside an answer (a long prefill on a server without keep-alives)
                                     # while the replica's health checks pass; a failed one ends the wait at once
    api_key = "..."                  # sent to the upstreams as Authorization: Bearer
    reasoning = "parsed"             # where the replicas put the thinking: "parsed" (reasoning_content: their
                                     # reasoning parser split it), "content" (none: the proxy splits it at </think>)
                                     # or "auto" (each replica's first thinking answer, held back, shows which)
    [models]                         # the agent's model name -> the upstream's; first match wins, * and ? as in a shell
    "claude-*" = "qwen3.6-35b-a3b"
    "*" = "qwen3.6-35b-a3b"
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from proxy.upstream.routing import POLICIES

_FILE_KEYS = {"upstreams": "urls", "routing": "routing", "health_interval": "health_interval_s",
              "connect_timeout": "connect_timeout_s", "read_timeout": "read_timeout_s", "api_key": "api_key",
              "models": "model_map", "reasoning": "reasoning"}
REASONING = ("parsed", "content", "auto")


@dataclass(frozen=True)
class UpstreamConfig:
    urls: tuple[str, ...]
    model_map: tuple[tuple[str, str], ...] = ()  # (agent's model pattern, upstream model name)
    default_model: Optional[str] = None  # for names no pattern matches: what the upstream lists, else as sent
    routing: str = "session"
    health_interval_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    api_key: Optional[str] = None
    forward_headers: tuple[str, ...] = ()  # request headers passed on (replay's forced answers)
    reasoning: str = "parsed"  # one of REASONING (the file's comment above)

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(base_url(u) for u in self.urls))
        if not self.urls:
            raise ValueError("upstream mode needs at least one replica: --upstream URL (repeatable)")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if self.reasoning not in REASONING:
            raise ValueError(f"--upstream-reasoning (reasoning) must be one of {', '.join(REASONING)}, got "
                             f"{self.reasoning!r}")
        for name, flag in (("health_interval_s", "--health-interval"), ("connect_timeout_s", None),
                           ("read_timeout_s", "--upstream-timeout")):
            if not getattr(self, name) > 0:
                key = name.removesuffix("_s")
                raise ValueError(f"{flag + ' (' + key + ')' if flag else key} must be > 0 seconds, got "
                                 f"{getattr(self, name)}")

    def upstream_model(self, model: str) -> str:
        for pattern, target in self.model_map:
            if fnmatch.fnmatchcase(model, pattern):
                return target
        return self.default_model or model

    @classmethod
    def load(cls, path: str | Path, **overrides) -> "UpstreamConfig":
        """A TOML or JSON file; `overrides` (the command line's, None = not given) win over it."""
        p = Path(path)
        text = p.read_text()
        try:
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
        unknown = set(data) - set(_FILE_KEYS)
        if unknown:
            raise ValueError(f"{p}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(_FILE_KEYS)})")
        kw = {_FILE_KEYS[k]: v for k, v in data.items()}
        if "urls" in kw and not (isinstance(kw["urls"], list) and all(isinstance(u, str) for u in kw["urls"])):
            raise ValueError(f"{p}: upstreams must be a list of URLs")
        if "model_map" in kw:
            if not isinstance(kw["model_map"], dict) or not all(isinstance(v, str) for v in kw["model_map"].values()):
                raise ValueError(f"{p}: [models] maps model names to upstream model names (strings)")
            kw["model_map"] = tuple(kw["model_map"].items())
        kw.update({k: v for k, v in overrides.items() if v not in (None, (), [])})
        kw["urls"] = tuple(kw.get("urls", ()))
        return cls(**{f.name: kw[f.name] for f in fields(cls) if f.name in kw})


def refused_key(url: str, status: int) -> str:
    """What to do when a replica refuses the key killick sends it (none, or not its --api-key)."""
    return (f"upstream {url} refused killick's key (HTTP {status}): start killick serve with --upstream-api-key KEY "
            "(the replica's --api-key) or api_key in --upstream-config")


def base_url(url: str, what: str = "an upstream") -> str:
    """http(s)://host:port[/prefix] without a trailing / or /v1 (the routes are appended to it)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{what} must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def parse_model_map(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """`--upstream-model PATTERN=NAME` (or a bare NAME for every model) -> (pattern, name) pairs."""
    out = []
    for pair in pairs:
        pattern, sep, name = pair.partition("=")
        if not sep:
            pattern, name = "*", pair
        if not pattern or not name:
            raise ValueError(f"--upstream-model takes PATTERN=NAME or NAME, got {pair!r}")
        out.append((pattern, name))
    return tuple(out)


def add_upstream_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("upstream mode: OpenAI-compatible servers answer instead of a local engine")
    g.add_argument("--upstream", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8000 (repeatable); no model is loaded")
    g.add_argument("--upstream-config", metavar="FILE", help="TOML/JSON: upstreams, models, routing, timeouts, "
                                                             "api_key (flags given here win)")
    g.add_argument("--upstream-model", action="append", default=[], metavar="PATTERN=NAME",
                   help="send agents' model PATTERN (* and ? as in a shell) as NAME; a bare NAME maps every model "
                        "(repeatable, first match wins; default: the model the upstream lists)")
    g.add_argument("--routing", choices=["session", "round-robin"], default=None,
                   help="session: each session sticks to one replica (default); round-robin: for comparison")
    g.add_argument("--health-interval", type=float, metavar="S", help="seconds between health checks (default 5)")
    g.add_argument("--upstream-timeout", type=float, metavar="S",
                   help="longest silence inside an upstream's answer while its health checks pass (default 600; "
                        "a failed check ends the wait at once)")
    g.add_argument("--upstream-api-key", metavar="KEY", help="sent to the upstreams as Authorization: Bearer")
    g.add_argument("--upstream-reasoning", choices=REASONING, default=None,
                   help="where the replicas put the thinking: parsed (reasoning_content, from their reasoning "
                        "parser; default), content (no reasoning parser: the proxy splits it at </think>), auto "
                        "(learned per replica from its first thinking answer, which is held back until it shows)")


def config_from_args(args: argparse.Namespace) -> UpstreamConfig:
    from proxy.replay.scripted import FORCE_RESPONSE_HEADER

    flags = {"urls": tuple(args.upstream), "model_map": parse_model_map(args.upstream_model),
             "routing": args.routing, "health_interval_s": args.health_interval,
             "read_timeout_s": args.upstream_timeout, "api_key": args.upstream_api_key,
             "reasoning": args.upstream_reasoning,
             "forward_headers": (FORCE_RESPONSE_HEADER,) if args.allow_forced_responses else ()}
    if args.upstream_config:
        return UpstreamConfig.load(args.upstream_config, **flags)
    return UpstreamConfig(**{k: v for k, v in flags.items() if v is not None})
