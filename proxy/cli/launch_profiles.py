"""What `killick launch` knows about each agent harness, as data (no I/O here).

A profile turns what the server says about itself (`Served`: URL, model, context window, key) and the user's
environment into a `LaunchPlan`: the command line, the variables to set and to remove, and the config files to
write (merged into what the user already has).
Values here were checked against real runs of each harness on loopback; see fixtures/harness_requests/.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from proxy.cli import KEY_ENV  # the server's --api-key goes to the agent in this variable (openclaw: its own file)

DUMMY_KEY = "sk-killick-local"  # every harness insists on some key; ours never leaves the machine
DEFAULT_WINDOW = 32768  # what a server that does not say its context_length is assumed to take

# Provider credentials and endpoints a harness could fall back to; removed from the child's environment.
SCRUB_PREFIXES = ("ANTHROPIC_", "OPENAI_", "AZURE_OPENAI_", "OPENROUTER_", "LITELLM_")
SCRUB_SUFFIXES = ("_API_KEY", "_AUTH_TOKEN", "_OAUTH_TOKEN")
SCRUB_NAMES = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY",
               "AWS_BEARER_TOKEN_BEDROCK", "VERTEX_PROJECT", "CLOUD_ML_REGION", "CODEX_API_KEY",
               "OPENCODE_CONFIG", "OPENCODE_CONFIG_CONTENT", "MSWEA_MODEL_NAME")

# Telemetry, crash reports and self-update off for everything we start.
QUIET_ENV = {"DO_NOT_TRACK": "1", "DISABLE_TELEMETRY": "1"}


@dataclass(frozen=True)
class Served:
    """The server as the agent must see it: where, which model, how many tokens a request may hold, which key."""

    url: str
    model: str
    context: int = DEFAULT_WINDOW  # /v1/models context_length: prompt + output of one request
    api_key: str = DUMMY_KEY

    @property
    def max_output(self) -> int:
        """What an agent may ask for as output: 16k, but never more than a quarter of the window."""
        return max(1, min(16384, self.context // 4))


@dataclass(frozen=True)
class ConfigFile:
    path: Path
    content: str          # the whole file as it will be written (user's keys kept)
    existed: bool          # a backup <path>.killick-bak is written once before the first change


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    set_env: dict[str, str]
    unset_env: list[str]
    files: list[ConfigFile] = field(default_factory=list)


@dataclass(frozen=True)
class Profile:
    name: str
    binary: str
    install: str                              # the exact command printed when `binary` is missing
    env: Callable[[Served], dict[str, str]]    # variables to set
    argv: Callable[[Served], list[str]]        # arguments before the user's
    files: Callable[[Served, Mapping[str, str]], list[ConfigFile]] = lambda served, env: []


def scrubbed(env: Mapping[str, str], keep: Mapping[str, str]) -> list[str]:
    """Names in `env` that could point a harness at a paid endpoint (except those we set ourselves)."""
    def risky(name: str) -> bool:
        return (name.startswith(SCRUB_PREFIXES) or name.endswith(SCRUB_SUFFIXES) or name in SCRUB_NAMES)
    return sorted(n for n in env if risky(n) and n not in keep)


# An agent's stream idle timeout (Claude Code's, Codex's: 300 s by default, keep-alive pings and comments not
# counted), raised to an hour: a whole-context prefill off the GPU, or a queue behind other requests, takes minutes
STREAM_IDLE_MS = 3_600_000

# --- Claude Code: all by environment -------------------------------------------------------------------


def _claude_env(served: Served) -> dict[str, str]:
    model = served.model
    return {
        "ANTHROPIC_BASE_URL": served.url,              # it appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": served.api_key,        # a bearer token: no "use this API key?" prompt
        "ANTHROPIC_MODEL": model,
        # its window for a model whose name does not start with "claude-" (else 200k): /context and compaction
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.context),
        "ANTHROPIC_SMALL_FAST_MODEL": model,           # titles and quick checks go to the same model
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",         # the per-request billing line would break prefix reuse
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # it gives up on a stream that sends no event for max(this, 300 s); serve's empty thinking deltas count,
        # but not with thinking off
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_IDLE_MS),
    }



# --- OpenCode: a `killick` provider merged into the user's opencode.json; the model picked by flag --------

def opencode_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "opencode" / "opencode.json"


def _opencode_files(served: Served, env: Mapping[str, str]) -> list[ConfigFile]:
    path, model = opencode_config_path(env), served.model
    config = _read_json(path)
    providers = config.setdefault("provider", {})
    if not isinstance(providers, dict):
        raise ValueError(f"{path}: 'provider' is not an object; fix the file or remove that key")
    providers["killick"] = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "killick (local)",
        "options": {"baseURL": f"{served.url}/v1", "apiKey": "{env:%s}" % KEY_ENV},  # opencode reads the variable
        "models": {model: {"name": model, "tool_call": True, "reasoning": True,
                           "limit": {"context": served.context, "output": served.max_output}}},
    }
    config.setdefault("$schema", "https://opencode.ai/config.json")
    return [config_file(path, config, ("provider", "killick"), ("$schema",))]


def config_file(path: Path, config: dict, *ours: tuple[str, ...]) -> ConfigFile:
    """The merged file; `existed` (so a backup is kept) only when it holds something of the user's, i.e. more
    than the keys at the paths `ours` that killick itself writes."""
    if not path.exists():
        return ConfigFile(path, json.dumps(config, indent=2) + "\n", False)
    rest = _read_json(path)
    for keys in ours:
        parent = rest
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(keys[-1], None)
    return ConfigFile(path, json.dumps(config, indent=2) + "\n", _has_content(rest))


def _has_content(value) -> bool:
    """A JSON value with anything but empty objects in it."""
    return any(_has_content(v) for v in value.values()) if isinstance(value, dict) else True


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not plain JSON ({exc.msg}, line {exc.lineno}); killick will not rewrite "
                         f"it - remove the comments or add the provider shown by `--dry-run` yourself") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; fix or move it and try again")
    return data


# --- Codex: `-c` overrides on the command line, nothing written -----------------------------------------

def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def _codex_argv(served: Served) -> list[str]:
    overrides = {
        "model": _toml_str(served.model),
        "model_provider": '"killick"',
        "model_providers.killick.name": '"killick"',
        "model_providers.killick.base_url": _toml_str(f"{served.url}/v1"),
        "model_providers.killick.env_key": _toml_str(KEY_ENV),
        "model_providers.killick.wire_api": '"responses"',
        # it gives up on a stream with no SSE event (comments are none) for this long, 300 s by default, and sends
        # the whole request again, five times; serve's Responses keep-alives are events, this guards the rest
        "model_providers.killick.stream_idle_timeout_ms": str(STREAM_IDLE_MS),
        "model_context_window": str(served.context),
        "sandbox_mode": '"workspace-write"',  # its default (read-only) lets the shell tool write nothing
        "check_for_update_on_startup": "false",
        "analytics.enabled": "false",
        "otel.exporter": '"none"',
        "features.plugins": "false",  # else it syncs curated plugins from github.com and chatgpt.com at start
    }
    argv = ["codex"]
    for key, value in overrides.items():
        argv += ["-c", f"{key}={value}"]
    return argv


# --- mini-swe-agent: litellm model name + api_base on the command line ----------------------------------

MINI_STEP_LIMIT = 50  # cost_limit=0 means no limit: a model that never submits would loop forever


def _mini_argv(served: Served) -> list[str]:
    return ["mini", "-m", f"openai/{served.model}", "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={served.url}/v1",
            "-c", "agent.cost_limit=0", "-c", f"agent.step_limit={MINI_STEP_LIMIT}"]


# --- OpenClaw: a `killick` provider merged into ~/.openclaw/openclaw.json -------------------------------

def openclaw_config_path(env: Mapping[str, str]) -> Path:
    if env.get("OPENCLAW_CONFIG_PATH"):
        return Path(env["OPENCLAW_CONFIG_PATH"])
    home = env.get("OPENCLAW_HOME") or env.get("HOME", "~")
    state = env.get("OPENCLAW_STATE_DIR") or str(Path(home).expanduser() / ".openclaw")
    return Path(state) / "openclaw.json"


def _openclaw_files(served: Served, env: Mapping[str, str]) -> list[ConfigFile]:
    path, model = openclaw_config_path(env), served.model
    config = _read_json(path)
    models = config.setdefault("models", {"mode": "merge"})  # merge: keep OpenClaw's built-in providers
    providers = models.setdefault("providers", {}) if isinstance(models, dict) else None
    if not isinstance(providers, dict):
        raise ValueError(f"{path}: 'models.providers' is not an object; fix the file or remove that key")
    providers["killick"] = {
        "baseUrl": f"{served.url}/v1", "apiKey": served.api_key, "api": "openai-completions",
        "models": [{"id": model, "name": model, "reasoning": True, "input": ["text"],
                    "contextWindow": served.context, "maxTokens": served.max_output,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}],
    }
    agents = config.setdefault("agents", {})
    defaults = agents.setdefault("defaults", {}) if isinstance(agents, dict) else None
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: 'agents.defaults' is not an object; fix the file or remove that key")
    defaults["model"] = {"primary": f"killick/{model}"}
    allowed = defaults.setdefault("models", {})  # the per-agent model allowlist onboarding also fills
    if isinstance(allowed, dict):
        allowed.setdefault(f"killick/{model}", {})
    return [config_file(path, config, ("models", "providers", "killick"), ("models", "mode"),
                        ("agents", "defaults", "model"), ("agents", "defaults", "models", f"killick/{model}"))]


PROFILES: dict[str, Profile] = {
    "claude": Profile(
        "claude", "claude", "npm install -g @anthropic-ai/claude-code",
        env=_claude_env, argv=lambda served: ["claude"]),
    "opencode": Profile(
        "opencode", "opencode", "npm install -g opencode-ai   # and: apt-get install ripgrep",
        env=lambda served: {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                            "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                            KEY_ENV: served.api_key},
        argv=lambda served: ["opencode", "--model", f"killick/{served.model}"],
        files=_opencode_files),
    "codex": Profile(
        "codex", "codex", "npm install -g @openai/codex",
        env=lambda served: {KEY_ENV: served.api_key}, argv=_codex_argv),
    "openclaw": Profile(
        "openclaw", "openclaw",
        "npm install -g openclaw   # needs Node >= 24.16 (older Node installs an empty placeholder); or in a "
        "folder: npm install node@24 openclaw && export PATH=$PWD/node_modules/.bin:$PATH",
        env=lambda served: {"OPENCLAW_NO_AUTO_UPDATE": "1"}, argv=lambda served: ["openclaw"],
        files=_openclaw_files),
    "mini-swe-agent": Profile(
        "mini-swe-agent", "mini", "python3 -m pip install mini-swe-agent   # best in its own venv",
        env=lambda served: {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
                            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": served.api_key},
        argv=_mini_argv),
}

_MODEL_NAME = re.compile(r"^[\w.:/@+-]+$")


def plan(agent: str, served: Served, env: Mapping[str, str], extra: list[str]) -> LaunchPlan:
    """The full launch for `agent` against the `served` model, given the user's environment."""
    if agent not in PROFILES:
        raise ValueError(f"unknown agent {agent!r}; choose one of {', '.join(PROFILES)}")
    if not _MODEL_NAME.match(served.model):
        raise ValueError(f"the server's model id {served.model!r} has characters killick will not put in a config")
    profile = PROFILES[agent]
    served = replace(served, url=served.url.rstrip("/"))
    set_env = {**QUIET_ENV, **profile.env(served)}
    return LaunchPlan(argv=profile.argv(served) + list(extra), set_env=set_env,
                      unset_env=scrubbed(env, set_env), files=profile.files(served, env))
