"""What `killick launch` knows about each agent harness, as data (no I/O here).

A profile turns (server URL, served model name, the user's environment) into a `LaunchPlan`: the command line,
the variables to set and to remove, and the config files to write (merged into what the user already has).
Values here were checked against real runs of each harness on loopback; see fixtures/harness_requests/.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

DUMMY_KEY = "sk-killick-local"  # every harness insists on some key; ours never leaves the machine

# Provider credentials and endpoints a harness could fall back to; removed from the child's environment.
SCRUB_PREFIXES = ("ANTHROPIC_", "OPENAI_", "AZURE_OPENAI_", "OPENROUTER_", "LITELLM_")
SCRUB_SUFFIXES = ("_API_KEY", "_AUTH_TOKEN", "_OAUTH_TOKEN")
SCRUB_NAMES = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY",
               "AWS_BEARER_TOKEN_BEDROCK", "VERTEX_PROJECT", "CLOUD_ML_REGION", "CODEX_API_KEY",
               "OPENCODE_CONFIG", "OPENCODE_CONFIG_CONTENT", "MSWEA_MODEL_NAME")

# Telemetry, crash reports and self-update off for everything we start.
QUIET_ENV = {"DO_NOT_TRACK": "1", "DISABLE_TELEMETRY": "1"}


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
    env: Callable[[str, str], dict[str, str]]  # (server, model) -> variables to set
    argv: Callable[[str, str], list[str]]      # (server, model) -> arguments before the user's
    files: Callable[[str, str, Mapping[str, str]], list[ConfigFile]] = lambda server, model, env: []


def scrubbed(env: Mapping[str, str], keep: Mapping[str, str]) -> list[str]:
    """Names in `env` that could point a harness at a paid endpoint (except those we set ourselves)."""
    def risky(name: str) -> bool:
        return (name.startswith(SCRUB_PREFIXES) or name.endswith(SCRUB_SUFFIXES) or name in SCRUB_NAMES)
    return sorted(n for n in env if risky(n) and n not in keep)


# --- Claude Code: all by environment -------------------------------------------------------------------

def _claude_env(server: str, model: str) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": server,                  # it appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": DUMMY_KEY,             # a bearer token: no "use this API key?" prompt
        "ANTHROPIC_MODEL": model,
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
    }


# --- OpenCode: a `killick` provider merged into the user's opencode.json; the model picked by flag --------

def opencode_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "opencode" / "opencode.json"


def _opencode_files(server: str, model: str, env: Mapping[str, str]) -> list[ConfigFile]:
    path = opencode_config_path(env)
    config = _read_json(path)
    providers = config.setdefault("provider", {})
    if not isinstance(providers, dict):
        raise ValueError(f"{path}: 'provider' is not an object; fix the file or remove that key")
    providers["killick"] = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "killick (local)",
        "options": {"baseURL": f"{server}/v1", "apiKey": DUMMY_KEY},
        "models": {model: {"name": model, "tool_call": True, "reasoning": True,
                           "limit": {"context": 131072, "output": 16384}}},
    }
    config.setdefault("$schema", "https://opencode.ai/config.json")
    return [ConfigFile(path, json.dumps(config, indent=2) + "\n", path.exists())]


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


def _codex_argv(server: str, model: str) -> list[str]:
    overrides = {
        "model": _toml_str(model),
        "model_provider": '"killick"',
        "model_providers.killick.name": '"killick"',
        "model_providers.killick.base_url": _toml_str(f"{server}/v1"),
        "model_providers.killick.env_key": '"KILLICK_API_KEY"',
        "model_providers.killick.wire_api": '"responses"',
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

def _mini_argv(server: str, model: str) -> list[str]:
    return ["mini", "-m", f"openai/{model}", "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={server}/v1",
            "-c", f"model.model_kwargs.api_key={DUMMY_KEY}",
            "-c", "agent.cost_limit=0"]


# --- OpenClaw: a `killick` provider merged into ~/.openclaw/openclaw.json -------------------------------

def openclaw_config_path(env: Mapping[str, str]) -> Path:
    if env.get("OPENCLAW_CONFIG_PATH"):
        return Path(env["OPENCLAW_CONFIG_PATH"])
    home = env.get("OPENCLAW_HOME") or env.get("HOME", "~")
    state = env.get("OPENCLAW_STATE_DIR") or str(Path(home).expanduser() / ".openclaw")
    return Path(state) / "openclaw.json"


def _openclaw_files(server: str, model: str, env: Mapping[str, str]) -> list[ConfigFile]:
    path = openclaw_config_path(env)
    config = _read_json(path)
    models = config.setdefault("models", {"mode": "merge"})  # merge: keep OpenClaw's built-in providers
    providers = models.setdefault("providers", {}) if isinstance(models, dict) else None
    if not isinstance(providers, dict):
        raise ValueError(f"{path}: 'models.providers' is not an object; fix the file or remove that key")
    providers["killick"] = {
        "baseUrl": f"{server}/v1", "apiKey": DUMMY_KEY, "api": "openai-completions",
        "models": [{"id": model, "name": model, "reasoning": True, "input": ["text"],
                    "contextWindow": 131072, "maxTokens": 16384,
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
    return [ConfigFile(path, json.dumps(config, indent=2) + "\n", path.exists())]


PROFILES: dict[str, Profile] = {
    "claude": Profile(
        "claude", "claude", "npm install -g @anthropic-ai/claude-code",
        env=_claude_env, argv=lambda server, model: ["claude"]),
    "opencode": Profile(
        "opencode", "opencode", "npm install -g opencode-ai   # and: apt-get install ripgrep",
        env=lambda server, model: {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                                   "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"},
        argv=lambda server, model: ["opencode", "--model", f"killick/{model}"],
        files=_opencode_files),
    "codex": Profile(
        "codex", "codex", "npm install -g @openai/codex",
        env=lambda server, model: {"KILLICK_API_KEY": DUMMY_KEY}, argv=_codex_argv),
    "openclaw": Profile(
        "openclaw", "openclaw",
        "npm install -g openclaw   # needs Node >= 24.16 (older Node installs an empty placeholder); or in a "
        "folder: npm install node@24 openclaw && export PATH=$PWD/node_modules/.bin:$PATH",
        env=lambda server, model: {"OPENCLAW_NO_AUTO_UPDATE": "1"}, argv=lambda server, model: ["openclaw"],
        files=_openclaw_files),
    "mini-swe-agent": Profile(
        "mini-swe-agent", "mini", "python3 -m pip install mini-swe-agent   # best in its own venv",
        env=lambda server, model: {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
                                   "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        argv=_mini_argv),
}

_MODEL_NAME = re.compile(r"^[\w.:/@+-]+$")


def plan(agent: str, server: str, model: str, env: Mapping[str, str], extra: list[str]) -> LaunchPlan:
    """The full launch for `agent` against `server` serving `model`, given the user's environment."""
    if agent not in PROFILES:
        raise ValueError(f"unknown agent {agent!r}; choose one of {', '.join(PROFILES)}")
    if not _MODEL_NAME.match(model):
        raise ValueError(f"the server's model id {model!r} has characters killick will not put in a config")
    profile = PROFILES[agent]
    server = server.rstrip("/")
    set_env = {**QUIET_ENV, **profile.env(server, model)}
    return LaunchPlan(argv=profile.argv(server, model) + list(extra), set_env=set_env,
                      unset_env=scrubbed(env, set_env), files=profile.files(server, model, env))
