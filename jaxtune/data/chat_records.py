"""Chat records checked before their chat template renders them: `{"messages": [...]}`, and TRL's tool-calling
records `{"messages": [...], "tools": [...]}` (the OpenAI chat API's shape): an assistant message may carry
`tool_calls` [{"type": "function", "function": {"name", "arguments": {...}}}] and then needs no content; a tool's reply
is {"role": "tool", "content", "name"}; `tools` are JSON schemas (`jaxtune.environments.json_schema`, transformers'
`get_json_schema`) passed to the template as `tools`, as `apply_chat_template(messages, tools=tools)` does; content may
be TRL's parts [{"type": "text", "text"}, {"type": "image"}]. Errors name the record (`FILE:LINE`) and the field.
"""

from __future__ import annotations

import json

from jaxtune.data.sources import json_type
from jaxtune.errors import JaxtuneError


def _check_tool_call(where: str, i: int, k: int, call) -> None:
    field = f"messages[{i}].tool_calls[{k}]"
    if not isinstance(call, dict):
        raise JaxtuneError(f"{where}: chat field '{field}' must be an object, got {json_type(call)}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise JaxtuneError(f"{where}: chat field '{field}' must name its function: "
                           '{"type": "function", "function": {"name": ..., "arguments": {...}}}')
    arguments = function.get("arguments", {})
    if not isinstance(arguments, dict | str):
        raise JaxtuneError(f"{where}: chat field '{field}.arguments' must be an object, got {json_type(arguments)}")


def check_tools(where: str, record: dict) -> list[dict] | None:
    """record["tools"] (None when absent or null): a list of JSON-schema objects, each naming its function."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise JaxtuneError(f"{where}: chat field 'tools' must be an array of JSON schemas, got {json_type(tools)}")
    for k, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise JaxtuneError(f"{where}: chat field 'tools[{k}]' must be a function's JSON schema "
                               '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
    return tools


def _check_parts(where: str, i: int, parts: list) -> None:
    """A message's content as parts (TRL's vision format): {"type": "text", "text"} and {"type": "image"}."""
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" or (kind == "text" and isinstance(part.get("text"), str)):
            continue
        raise JaxtuneError(f"{where}: chat field 'messages[{i}].content[{k}]' must be {{\"type\": \"text\", "
                           f"\"text\": ...}} or {{\"type\": \"image\"}}, got {json.dumps(part)[:60]}")


def content_text(message: dict) -> str:
    """A message's text: its content string, or its text parts joined (image parts left out), stripped."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p["text"].strip() for p in content if p.get("type") == "text")
    return content.strip()


def check_messages(where: str, record: dict) -> list[dict]:
    """record["messages"]: a non-empty list of {"role", "content"} objects (tool calls as above; content a string or
    a list of text and image parts) with at least one assistant message to train on."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise JaxtuneError(f"{where}: chat field 'messages' must be a non-empty array, got {json_type(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise JaxtuneError(f"{where}: chat field 'messages[{i}]' must be an object, got {json_type(m)}")
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise JaxtuneError(f"{where}: chat field 'messages[{i}].tool_calls' must be an array on an assistant "
                                   f"message, got {json_type(calls)} on role {m.get('role')!r}")
            for k, call in enumerate(calls):
                _check_tool_call(where, i, k, call)
        for name in ("role", "content"):
            if name == "content" and calls and m.get("content") is None:  # a turn that only calls tools
                continue
            if name not in m:
                raise JaxtuneError(f"{where}: chat record is missing field 'messages[{i}].{name}'")
            if name == "content" and isinstance(m[name], list):
                _check_parts(where, i, m[name])
            elif not isinstance(m[name], str):
                raise JaxtuneError(f"{where}: chat field 'messages[{i}].{name}' must be a string, "
                                   f"got {json_type(m[name])}")
    if not any(m["role"] == "assistant" for m in messages):
        raise JaxtuneError(f"{where}: chat record has no assistant message to train on")
    return messages
