"""Renders chat templates the way Hugging Face transformers does (apply_chat_template's Jinja2
environment), as the reference the engine's @huggingface/jinja rendering is checked against.

Reads a JSON list of {"template": str, "context": {...}} on stdin and writes a JSON list of
{"text": str} or {"error": str}, one per case.
"""
import json
import sys
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class Generation(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` block (it marks the assistant's
    tokens for return_assistant_tokens_mask): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
)
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

out = []
for case in json.load(sys.stdin):
    try:
        out.append({"text": env.from_string(case["template"]).render(**case["context"])})
    except Exception as err:  # noqa: BLE001 - reported to the test as the reference's refusal
        out.append({"error": str(err)})
json.dump(out, sys.stdout)
