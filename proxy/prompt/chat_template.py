"""Jinja environment for chat templates, behaving like transformers' apply_chat_template.

Real model directories ship templates written for transformers, so they get the same environment:
sandboxed, trim_blocks/lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII and does not
HTML-escape, `raise_exception`, `strftime_now`, and the `{% generation %}` block (rendered as-is).
"""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here a no-op."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

    def _passthrough(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str, origin: str = "chat template"):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"{origin} does not compile ({e}); fix the template") from None


def render_template(template, origin: str = "chat template", **variables) -> str:
    try:
        return template.render(**variables)
    except TemplateError as e:
        raise ValueError(f"{origin} refused the conversation: {e}") from None
