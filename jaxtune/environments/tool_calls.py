"""Tool calls read from a model's turn by its chat-template family (`parse_tool_calls`, `detect_family`): "hermes"
(Qwen2.5/3, Hermes, SmolLM3: `<tool_call>{"name", "arguments"}</tool_call>`), "llama3" (Llama 3.1-3.3: a turn that is
`{"name", "parameters"}` JSON, `<|python_tag|>` before it or before a built-in `name.call(k=v)`), "harmony" (gpt-oss:
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`), "xml" (Qwen3.5, Qwen3-Coder,
Nemotron 3: `<function=NAME><parameter=KEY>`), "glm" (GLM-4.5: `<arg_key>`); after vLLM's parsers and the harmony
spec. A call the model got wrong is not an exception but a `ToolCallError`, whose one line the environment sends back
as the tool's reply: the episode goes on.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """A call to run: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict

    def message_call(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (TRL's and the OpenAI API's shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    """A call the model wrote but that cannot run; `message` is one line the model reads back as the tool's reply."""

    message: str
    name: str | None = None  # the tool it meant, when that could be read


@dataclass(frozen=True)
class ParsedTurn:
    """A model's turn: its content (the text outside the calls), its reasoning where the format separates it, and its
    calls in order, each a `ToolCall` or a `ToolCallError`."""

    content: str
    calls: tuple[ToolCall | ToolCallError, ...] = ()
    reasoning: str | None = None
    valid: tuple[ToolCall, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "valid", tuple(c for c in self.calls if isinstance(c, ToolCall)))


def _loads_object(text: str, where: str) -> dict | ToolCallError:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: {where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    if not isinstance(value, dict):
        return ToolCallError(f"error: {where} must be a JSON object, got {type(value).__name__}")
    return value


def _call(value: dict, where: str, arguments_keys: tuple[str, ...]) -> ToolCall | ToolCallError:
    """A call from a decoded object {"name", <one of arguments_keys>}; arguments may be a JSON string of an object."""
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(f"error: {where} has no \"name\" (expected {{\"name\": ..., \"{arguments_keys[0]}\": "
                             "{...}})")
    arguments: object = next((value[k] for k in arguments_keys if k in value), {})
    if isinstance(arguments, str):
        arguments = _loads_object(arguments, f"the arguments of {where} ({name})")
        if isinstance(arguments, ToolCallError):
            return ToolCallError(arguments.message, name)
    if not isinstance(arguments, dict):
        return ToolCallError(f"error: the arguments of {where} ({name}) must be a JSON object, got "
                             f"{type(arguments).__name__}", name)
    return ToolCall(name, arguments)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Calls in `<tool_call>...</tool_call>` tags, any number; the content is the text outside them. A last tag left
    open (a turn cut short) is still read when what follows it is a JSON object, as vLLM's `hermes` parser does."""
    calls: list[ToolCall | ToolCallError] = []
    for k, match in enumerate(_HERMES.finditer(text), 1):
        where = f"tool call {k}"
        value = _loads_object(match.group(1).strip(), where)
        if isinstance(value, ToolCallError) and not match.group(2):
            value = ToolCallError(f"error: {where}: <tool_call> is not closed by </tool_call> and what follows it is "
                                  "not a JSON object")
        calls.append(value if isinstance(value, ToolCallError) else _call(value, where, ("arguments", "parameters")))
    return ParsedTurn(_HERMES.sub("", text).strip(), tuple(calls))


PYTHON_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")


def _python_call(text: str, where: str) -> ToolCall | ToolCallError:
    """A built-in tool's call as Llama writes it after <|python_tag|>: `brave_search.call(query="...")`."""
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("not a call with keyword arguments")
        func = node.func
        name = func.value if isinstance(func, ast.Attribute) and func.attr == "call" else func
        if not isinstance(name, ast.Name):
            raise ValueError("not name.call(...)")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError) as e:
        return ToolCallError(f"error: {where} after <|python_tag|> is neither JSON nor name.call(key=value, ...) ({e})")
    return ToolCall(name.id, arguments)


def parse_llama3(text: str) -> ParsedTurn:
    """A turn that starts with `{` (or `<|python_tag|>`) is calls: JSON objects {"name", "parameters"} ("arguments"
    too) joined by `;`, as vLLM's `llama3_json` reads them, or a built-in tool's `name.call(key=value)` after the tag
    (Meta's prompt format); any other turn is a plain answer."""
    body = text.strip()
    for end in _LLAMA_ENDS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(PYTHON_TAG)
    body = body.removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip(), (_python_call(body, "tool call 1"),) if tagged else ())
    calls: list[ToolCall | ToolCallError] = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        where = f"tool call {len(calls) + 1}"
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            calls.append(ToolCallError(f"error: {where} is not valid JSON ({e.msg} at line {e.lineno} column "
                                       f"{e.colno})"))
            break
        calls.append(_call(value, where, ("parameters", "arguments")) if isinstance(value, dict) else
                     ToolCallError(f"error: {where} must be a JSON object, got {type(value).__name__}"))
        at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
    return ParsedTurn("", tuple(calls))


# One harmony message: [<|start|>ROLE-HEADER]<|channel|>HEADER[<|constrain|>FORMAT]<|message|>BODY END, where the
# recipient (to=...) may sit in either header, the text's start may hold the rest of a role header whose
# `<|start|>assistant` was the generation prompt (" to=functions.NAME"), and END is <|end|>, <|call|>, <|return|>, the
# next <|start|> or the text's end (a turn cut short, or a stop token the rollout did not keep).
_HARMONY = re.compile(r"(?:(?:<\|start\|>|^)(?P<role>[^<]*))?<\|channel\|>(?P<header>[^<]*)(?:<\|constrain\|>[^<]*)?"
                      r"<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|\Z)", re.DOTALL)
_RECIPIENT = re.compile(r"\bto=(\S+)")


def parse_harmony(text: str) -> ParsedTurn:
    """gpt-oss's turn after `<|start|>assistant`, message by message: a recipient (`to=functions.NAME`, in the
    header after the role or after the channel) makes a call, its body the JSON arguments; `analysis` is reasoning;
    `final` and commentary without a recipient are the content. A text with no harmony header is the content."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall | ToolCallError] = []
    for match in _HARMONY.finditer(text):
        header = f"{match.group('role') or ''} {match.group('header')}"
        channel = match.group("header").split()[0] if match.group("header").split() else ""
        recipient = _RECIPIENT.search(header)
        body = match.group("body").strip()
        if recipient:
            name = recipient.group(1).removeprefix("functions.")
            where = f"tool call {len(calls) + 1}"
            value = _loads_object(body, f"{where} ({name})")
            calls.append(ToolCallError(value.message, name) if isinstance(value, ToolCallError) else
                         ToolCall(name, value))
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not calls and not content and not reasoning:  # no harmony header at all: the text is the answer
        content = [text.strip()]
    return ParsedTurn("\n".join(content), tuple(calls), "\n".join(reasoning) or None)


def _parameter_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """{tool: {argument: its JSON type}} from the tools' schemas."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name")] = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    return types


def _value(text: str, kind) -> object:
    """An argument written as text (the XML families write a string as it is, anything else as JSON or Python's
    str()): kept a string when its schema says string, else read as JSON (True/False/None as Python writes them)."""
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def _xml_calls(text: str, tools: list[dict] | None, read_block) -> ParsedTurn:
    """Calls in <tool_call> blocks whose insides `read_block(body, where) -> (name, [(key, value text)])` reads (or
    a ToolCallError); values typed by the tools' schemas."""
    types = _parameter_types(tools)
    calls: list[ToolCall | ToolCallError] = []
    for k, match in enumerate(_HERMES.finditer(text), 1):
        read = read_block(match.group(1), f"tool call {k}")
        if isinstance(read, ToolCallError):
            calls.append(read)
            continue
        name, pairs = read
        kinds = types.get(name, {})
        calls.append(ToolCall(name, {key: _value(value, kinds.get(key)) for key, value in pairs}))
    return ParsedTurn(_HERMES.sub("", text).strip(), tuple(calls))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_block(body: str, where: str):
    match = _FUNCTION.match(body)
    if not match:
        return ToolCallError(f"error: {where} has no <function=NAME> inside <tool_call>")
    name = match.group(1).strip()
    if not match.group(3):
        return ToolCallError(f"error: {where} ({name}): <function={name}> is not closed by </function>", name)
    return name, [(key.strip(), value) for key, value in _PARAMETER.findall(match.group(2))]


def parse_xml(text: str, tools: list[dict] | None = None) -> ParsedTurn:
    """Qwen3.5/3.6, Qwen3-Coder and Nemotron 3's calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
    \\n</parameter>...</function>\\n</tool_call>`, values typed by the tools' schemas (vLLM's `qwen3_coder`)."""
    return _xml_calls(text, tools, _xml_block)


_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_block(body: str, where: str):
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "<" in name:
        return ToolCallError(f"error: {where} has no function name after <tool_call>")
    return name, [(key.strip(), value) for key, value in _ARGUMENT.findall(body)]


def parse_glm(text: str, tools: list[dict] | None = None) -> ParsedTurn:
    """GLM-4.5/4.6's calls: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>`,
    values typed by the tools' schemas (vLLM's `glm45`)."""
    return _xml_calls(text, tools, _glm_block)


PARSERS = {"hermes": parse_hermes, "qwen": parse_hermes, "llama3": parse_llama3, "harmony": parse_harmony,
           "gpt-oss": parse_harmony, "xml": parse_xml, "qwen3_coder": parse_xml, "glm": parse_glm}
_TYPED = {"xml", "qwen3_coder", "glm"}  # the families whose values are text, typed by the tools' schemas


def parse_tool_calls(text: str, family: str, tools: list[dict] | None = None) -> ParsedTurn:
    """The calls in a model's turn, read as `family` writes them ("hermes", "llama3", "harmony", "xml", "glm"; or an
    alias in PARSERS); `tools`: the schemas shown to the model, which type the XML families' argument values."""
    if family not in PARSERS:
        raise ValueError(f"tool-call family {family!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[family](text, tools) if family in _TYPED else PARSERS[family](text)  # type: ignore[call-arg]


def detect_family(chat_template: str | None) -> str | None:
    """The family a chat template's tool calls are written in, from its text; None when it shows none."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "harmony"
    if "<function=" in chat_template:
        return "xml"
    if "<arg_key>" in chat_template:
        return "glm"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and ("parameters" in chat_template or PYTHON_TAG in chat_template):
        return "llama3"
    return None
