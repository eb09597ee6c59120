"""Tool calls in chat: `tools`, `tool_choice` and `parallel_tool_calls` checked (`parse`), the tools
rendered into the prompt (`render`), the model's calls parsed out of its text into OpenAI
`tool_calls` (`Tools.split`), and `tool_choice` `required` or a named function turned into a
grammar (`Tools.grammar`), so the output is a call of an allowed tool whose arguments follow its
schema, exactly as any constrained output (core/grammar.py).

The call format is Hermes' (Qwen 2.5, Hermes and many chat templates use it):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A chat template that takes `tools`
renders them itself; one that does not (SmolLM2's) gets `GENERIC` as a system message listing
the tools and asking for that format, and earlier calls and results in the history are written
in it too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..core.errors import BatchspecError
from ..core.grammar import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Tools at most per request.
MAX_TOOLS = 128
GENERIC = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n"
    "To call a tool, answer with "
    + OPEN
    + '{{"name": <the tool\'s name>, "arguments": <its arguments as a JSON object>}}'
    + CLOSE
    + " and nothing else. Results come back inside <tool_response></tool_response>."
)
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class ToolError(BatchspecError):
    """A tool field the server refuses; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """The request's tools ({"name", "description", "parameters"} each) and its choice: "none",
    "auto", "required" or the name of the one function to call."""

    functions: tuple[dict, ...]
    choice: str

    @property
    def calls(self) -> bool:
        """The output may hold calls (the tools are offered)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output must be exactly one call (`required` or a named function)."""
        return self.choice not in ("none", "auto")

    def grammar(self) -> str | None:
        """A Lark grammar of one call of an allowed tool (None unless `forced`)."""
        if not self.forced:
            return None
        allowed = [f for f in self.functions if self.choice == "required" or f["name"] == self.choice]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        schema = {"anyOf": calls, "x-guidance": JSON_LAYOUT}
        return f'start: "{OPEN}" call "{CLOSE}"\ncall: %json {json.dumps(schema)}\n'

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(the content outside calls, or None if empty; OpenAI tool_calls) of a model's text. A
        block that is not a call of an offered tool stays in the content."""
        calls, kept, end = [], [], 0
        for match in _BLOCK.finditer(text):
            call = self._call(match.group(1))
            if call is None:
                continue
            kept.append(text[end : match.start()])
            end = match.end()
            calls.append(call)
        content = ("".join(kept) + text[end:]).strip() if calls else text
        return (content or None) if calls else text, calls

    def _call(self, body: str) -> dict | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        names = {f["name"] for f in self.functions}
        if (
            not isinstance(value, dict)
            or value.get("name") not in names
            or not isinstance(value.get("arguments"), dict)
        ):
            return None
        arguments = json.dumps(value["arguments"], ensure_ascii=False)
        return {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": value["name"], "arguments": arguments},
        }


def parse(body: dict) -> Tools | None:
    """The request's tools, or None when it offers none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' must be a boolean, got {parallel!r}"[:200], "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be distinct", "tools")
    picked = _choice(choice, names)
    if picked == "auto" and parallel is False:
        raise ToolError(
            "'parallel_tool_calls': false is served with 'tool_choice' 'required' or a named function (one call)",
            "parallel_tool_calls",
        )
    return Tools(functions, picked)


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(
            f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got {name!r}"[:200],
            f"{where}.function.name",
        )
    parameters = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"'{where}.function.parameters' must be a JSON schema object", f"{where}.function.parameters")
    description = f.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"'{where}.function.description' must be a string", f"{where}.function.description")
    return {"name": name, "description": description, "parameters": parameters}


def _choice(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return name
        raise ToolError(f"'tool_choice' names the function {name!r}, which is not among 'tools'"[:200], "tool_choice")
    raise ToolError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def supports_tools(tokenizer) -> bool:
    """The tokenizer's chat template renders `tools` itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render(messages: list[dict], tools: Tools | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for apply_chat_template) for a chat template that takes tools (`native`)
    or not: the generic form writes the tools into a system message and earlier calls and
    results as text."""
    offered = tools is not None and tools.calls
    if native:
        specs = [{"type": "function", "function": f} for f in tools.functions] if offered else None
        return [_native(m) for m in messages], specs
    out = [_generic(m) for m in messages]
    if offered:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
        note = GENERIC.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, None


def _native(message: dict) -> dict:
    """A message for a template that takes tools: a call's arguments as an object, as templates read them."""
    if "tool_calls" not in message:
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _generic(message: dict) -> dict:
    """A message written in the generic form: calls as blocks of text, results wrapped."""
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>{content}</tool_response>"}
    calls = message.get("tool_calls")
    if calls:
        blocks = [
            OPEN + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}) + CLOSE
            for c in calls
        ]
        content = content + "".join(blocks)
    return {"role": message["role"], "content": content}


def _loads(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class Stream:
    """One streamed choice's text: content passed on as it comes, except what may begin a call
    (held back until it does not, or until the end: a call is sent whole, as one delta)."""

    def __init__(self, tools: Tools):
        self.tools, self.held, self.calling = tools, "", False

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            return out
        keep = next((n for n in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-n:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(the content held back, or None; the calls) at the end of the choice."""
        if not self.calling:
            return self.held or None, []
        content, calls = self.tools.split(self.held)
        return content, calls
