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
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 64
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
    that does not parse, or names no tool, stays in the text. See `CallStream` for the text."""
    stream = CallStream({t.name for t in tools})
    head, calls = stream.feed(text)
    tail, more = stream.finish()
    return head + tail, calls + more


class CallStream:
    """Splits a choice's text, as it arrives, into what may be sent as content now and the calls
    whose blocks have closed. A call block is held from its first character (a trailing piece that
    could begin `<tool_call>` is held too) until it closes; a block that is not a call of a known
    tool goes out as text. Whitespace on either side of a call is dropped, so the content streamed
    equals the content of the whole text (`parse_calls`) chunk for chunk."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = frozenset(names)
        self.pending = ""  # text received and not yet sent
        self.after_call = False  # the pending text follows a call: its leading whitespace goes

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest, at the end of the text (an unclosed block is text)."""
        return self._advance(final=True)

    def _call(self, block: str) -> ToolCall | None:
        try:
            body = json.loads(block[len(CALL_OPEN):-len(CALL_CLOSE)])
        except ValueError:
            return None
        if not isinstance(body, dict) or body.get("name") not in self.names:
            return None
        arguments = body.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", body["name"], json.dumps(arguments, separators=(", ", ": ")))

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        sent: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.after_call:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_call = False
            start = self.pending.find(CALL_OPEN)
            close = self.pending.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
            if close >= 0:
                end = close + len(CALL_CLOSE)
                call = self._call(self.pending[start:end])
                if call is None:
                    sent.append(self.pending[:end])
                else:
                    sent.append(self.pending[:start].rstrip())
                    calls.append(call)
                    self.after_call = True
                self.pending = self.pending[end:]
                continue
            if final:
                sent.append(self.pending)
                self.pending = ""
                break
            # hold an open block, or a tail that may begin one, and the whitespace before it
            cut = start if start >= 0 else len(self.pending) - _partial_open(self.pending)
            safe = self.pending[:cut].rstrip()
            sent.append(safe)
            self.pending = self.pending[len(safe):]
            break
        return "".join(sent), calls


def _partial_open(text: str) -> int:
    """The length of the longest tail of `text` that is a proper beginning of `<tool_call>`."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def openai_message_calls(message: Any) -> list[dict]:
    """An OpenAI chat message's tool_calls ({"id", "type", "function": {"name", "arguments"}})
    as {"name", "arguments"} pairs (arguments: JSON text)."""
    out = []
    for c in message or []:
        function = c.get("function", {}) if isinstance(c, dict) else {}
        out.append({"name": function.get("name", ""), "arguments": function.get("arguments") or "{}"})
    return out
