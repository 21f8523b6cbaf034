"""Tool-calling SFT records ({"messages", "tools"}, TRL's format) through the real chat templates that write tool calls:
the text and ids are transformers' `apply_chat_template(messages, tools=tools)`, and the loss covers exactly the
assistant turns (tool calls included) and the token that ends each, never the tool replies or the tool list."""

import json

import env_tools
import pytest
from test_chat_templates import tokenizers
from test_data import trained_runs, write_jsonl

from jaxtune.data.formats import load_sft_examples, render_chat
from jaxtune.environments import json_schema, render_episode
from jaxtune.errors import JaxtuneError

pytestmark = pytest.mark.reference

TOOLS = [json_schema(env_tools.add), json_schema(env_tools.get_weather)]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
RECORD = {"messages": [{"role": "system", "content": "You add with tools."},
                       {"role": "user", "content": "What is 2 + 3?"},
                       {"role": "assistant", "tool_calls": [CALL]},
                       {"role": "tool", "name": "add", "content": "5"},
                       {"role": "assistant", "content": "Let me check once more.", "tool_calls": [CALL]},
                       {"role": "tool", "name": "add", "content": "5"},
                       {"role": "assistant", "content": "2 + 3 = 5."}],
          "tools": TOOLS}
ARGS = json.dumps(CALL["function"]["arguments"])
# Each assistant turn as the model writes it: its content, its calls, what ends the turn.
EXPECTED = {
    "qwen2_5": [f'<tool_call>\n{{"name": "add", "arguments": {ARGS}}}\n</tool_call><|im_end|>',
                f'Let me check once more.\n<tool_call>\n{{"name": "add", "arguments": {ARGS}}}\n</tool_call><|im_end|>',
                "2 + 3 = 5.<|im_end|>"],
    "qwen3": [f'<tool_call>\n{{"name": "add", "arguments": {ARGS}}}\n</tool_call><|im_end|>',
              f'Let me check once more.\n<tool_call>\n{{"name": "add", "arguments": {ARGS}}}\n</tool_call><|im_end|>',
              "<think>\n\n</think>\n\n2 + 3 = 5.<|im_end|>"],
}


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_tool_records_render_as_transformers_with_the_loss_on_assistant_turns(name, tmp_path):
    ours, theirs = tokenizers(name)
    rendered = theirs.apply_chat_template(RECORD["messages"], tools=TOOLS, tokenize=False)
    assert render_chat(RECORD["messages"], ours, tools=TOOLS) == rendered
    assert json.dumps(TOOLS[0]) in rendered  # the tool list reached the template
    (example,), stats = load_sft_examples(write_jsonl(tmp_path / "tools.jsonl", [RECORD]), ours, 4096)
    assert list(example.ids) == theirs.apply_chat_template(RECORD["messages"], tools=TOOLS, tokenize=True,
                                                           return_dict=False)
    assert [ours.decode(run, skip_special_tokens=False) for run in trained_runs(example)] == EXPECTED[name]
    assert render_episode(RECORD["messages"], ours, TOOLS) == example  # the environment's episodes mask alike


def test_llama3_writes_one_json_call_a_turn_and_trains_it(tmp_path):
    ours, theirs = tokenizers("llama3")
    messages = [m for m in RECORD["messages"][:4]] + [RECORD["messages"][-1]]  # one call a turn, its limit
    rendered = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert render_chat(messages, ours, tools=TOOLS) == rendered
    (example,), _ = load_sft_examples(write_jsonl(tmp_path / "tools.jsonl", [{"messages": messages, "tools": TOOLS}]),
                                      ours, 4096)
    assert ours.decode(example.ids, skip_special_tokens=False) == rendered
    assert [ours.decode(run, skip_special_tokens=False) for run in trained_runs(example)] == [
        f'{{"name": "add", "parameters": {ARGS}}}<|eot_id|>', "2 + 3 = 5.<|eot_id|>"]


@pytest.mark.parametrize("bad, message", [
    ({"tools": {"add": {}}}, "chat field 'tools' must be an array of JSON schemas, got object"),
    ({"tools": [{"type": "function"}]}, "chat field 'tools\\[0\\]' must be a function's JSON schema"),
    ({"calls": "add"}, "chat field 'messages\\[2\\].tool_calls' must be an array on an assistant message, got string"),
    ({"calls": [{"function": {"arguments": {}}}]}, "chat field 'messages\\[2\\].tool_calls\\[0\\]' must name its"),
    ({"calls": [{"name": "add", "arguments": [2, 3]}]},
     "chat field 'messages\\[2\\].tool_calls\\[0\\].arguments' must be an object, got array"),
])
def test_bad_tool_records_name_the_line_and_field(bad, message, tmp_path):
    ours, _ = tokenizers("qwen2_5")
    record = json.loads(json.dumps(RECORD))
    record.update({k: v for k, v in bad.items() if k == "tools"})
    if "calls" in bad:
        record["messages"][2]["tool_calls"] = bad["calls"]
    with pytest.raises(JaxtuneError, match=f"tools.jsonl:1: {message}"):
        load_sft_examples(write_jsonl(tmp_path / "tools.jsonl", [record]), ours, 4096)
