"""Tool calling on chat requests (OpenAI's `tools` and `tool_choice`): how the tools reach the
model, how a required call is constrained, and how calls are read back from the output.

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes format
that Qwen's and many other chat templates render. A chat template that takes tools (it mentions
`tools`) renders them; for one that does not (SmolLM2's), a system message lists them and says how
to call one, ahead of the conversation's own system message.

tool_choice:
- none: the tools are shown, nothing is parsed: the output is text;
- auto (the default with tools): the model writes text or calls; calls are parsed from the text;
- required: the output is one or more calls, each constrained (a Lark grammar with %json, see
  engine/structured_output.py) to one tool's name and parameter schema;
- a named function: the output is one call of that function, constrained likewise.
Constrained calls keep the output exactly the constrained target's, with speculation as without.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 64
CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
# JSON inside calls without whitespace between tokens (as JSON_LAYOUT in engine/structured_output.py)
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


class ToolError(ValueError):
    """A bad `tools` or `tool_choice` (the message names the field)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def parse_tools(tools: list[tuple[str, str, str]]) -> list[Tool]:
    """Tools from (name, description, parameters as JSON text) triples; ToolError when bad."""
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
    out, seen = [], set()
    for i, (name, description, parameters) in enumerate(tools):
        if not NAME_RE.match(name):
            raise ToolError(f"tools[{i}].name: 1-64 letters, digits, _ or -, got {name!r}")
        if name in seen:
            raise ToolError(f"tools[{i}].name: {name!r} is given twice")
        seen.add(name)
        try:
            schema = json.loads(parameters) if parameters else {"type": "object", "properties": {}}
        except ValueError as e:
            raise ToolError(f"tools[{i}].parameters: not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ToolError(f"tools[{i}].parameters: a JSON Schema object, got {type(schema).__name__}")
        out.append(Tool(name, description, schema))
    return out


def check_choice(choice: str, tools: list[Tool]) -> None:
    """`choice`: none, auto, required, or a tool's name."""
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ToolError("tool_choice: required, but no tools are given")
        return
    if choice not in {t.name for t in tools}:
        raise ToolError(f"tool_choice: {choice!r} is not one of the tools ({', '.join(t.name for t in tools)})")


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_tools(tools: list[Tool]) -> list[dict]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools]


def system_prompt(tools: list[Tool]) -> str:
    """What a template without a place for tools is given instead, as a system message."""
    listing = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in template_tools(tools))
    return ("You can call functions. They are listed here as JSON, one per line:\n" + listing +
            f"\nTo call one, answer with {CALL_OPEN}{{\"name\": <function name>, \"arguments\": <arguments as a JSON "
            f"object>}}{CALL_CLOSE}, one block per call and nothing else.")


def with_tools(messages: list[dict], tools: list[Tool], takes_tools: bool) -> list[dict]:
    """The conversation as the template is given it: assistant turns' tool_calls written in the
    call format where the template has no place for them, and the tools' system message first."""
    if not tools:
        return messages
    if takes_tools:
        return [{**m, "tool_calls": [{"type": "function", "function": {"name": c["name"],
                                                                       "arguments": json.loads(c["arguments"] or "{}")}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    out = [{"role": "system", "content": system_prompt(tools)}]
    for m in messages:
        calls = m.get("tool_calls") or []
        if calls:
            text = "".join(f"{CALL_OPEN}{json.dumps({'name': c['name'], 'arguments': json.loads(c['arguments'] or '{}')})}"
                           f"{CALL_CLOSE}" for c in calls)
            m = {"role": m["role"], "content": (m.get("content") or "") + text}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    return out


def render_chat(tokenizer: Any, messages: list[dict], tools: list[Tool]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, the tools shown as
    the template takes them (`with_tools`), the assistant's turn opened."""
    takes_tools = template_takes_tools(tokenizer.chat_template)
    shown = with_tools(messages, tools, takes_tools)
    extra = {"tools": template_tools(tools)} if tools and takes_tools else {}
    text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False, **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template has the specials


def call_grammar(tools: list[Tool], choice: str) -> str | None:
    """The Lark grammar a required or named call is constrained to (None: no constraint)."""
    if choice in ("none", "auto"):
        return None
    chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                         "required": ["name", "arguments"], "additionalProperties": False} for t in chosen], **COMPACT}
    repeat = "+" if choice == "required" else ""
    return (f'start: call{repeat}\ncall: "{CALL_OPEN}" body "{CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema)}")


def parse_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """(the text outside the call blocks, the calls of known tools whose body parses); a block
    that does not parse, or names no tool, stays in the text."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in CALL_RE.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or body.get("name") not in names or not isinstance(body.get("arguments", {}), dict):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", body["name"],
                              json.dumps(body.get("arguments", {}), separators=(", ", ": "))))
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def openai_message_calls(message: Any) -> list[dict]:
    """An OpenAI chat message's tool_calls ({"id", "type", "function": {"name", "arguments"}})
    as {"name", "arguments"} pairs (arguments: JSON text)."""
    out = []
    for c in message or []:
        function = c.get("function", {}) if isinstance(c, dict) else {}
        out.append({"name": function.get("name", ""), "arguments": function.get("arguments") or "{}"})
    return out
