"""Tool-calling SFT records ({"messages", "tools"}, TRL's format) through the real chat templates that write tool calls:
the text and ids are transformers' `apply_chat_template(messages, tools=tools)`, and the loss covers exactly the
assistant turns (tool calls included) and the token that ends each, never the tool replies or the tool list."""

import importlib.util
import json
from pathlib import Path

import env_tools
import pytest
from test_chat_templates import tokenizers
from test_data import trained_runs, write_jsonl

from jaxtune.data.formats import chat_spans, load_sft_examples, render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.environments import ToolCall, detect_family, json_schema, parse_tool_calls, render_episode
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


TRL_TEMPLATES = Path(importlib.util.find_spec("trl").origin).parent / "chat_templates"  # trl: pinned in [test]
FAMILIES = {"qwen2_5": "hermes", "qwen3": "hermes", "qwen3_8": "xml", "qwen3_5_think": "xml", "qwen3_6": "xml",
            "nemotron_3_super": "xml", "glm4moe": "glm", "llama3_1": "llama3", "gptoss": "harmony"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_reads_back_the_call_its_own_template_writes(name):
    """The models' own templates (TRL 1.16's copies) render a tool-calling turn as transformers does, and the parser
    of the family detected from the template reads the trained span of that turn back to the same call."""
    import transformers

    template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    assert detect_family(template) == FAMILIES[name]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "get_weather", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]
    ours = Tokenizer.byte_level()
    ours.chat_template = template
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, chat_template=template,
                                                  bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    text, spans = chat_spans(messages, ours, TOOLS)
    assert text == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    turn = parse_tool_calls(text[spans[0][0]:spans[0][1]], FAMILIES[name], TOOLS)
    assert turn.calls == (ToolCall("get_weather", {"city": "Paris", "days": 2}),)


def test_a_harmony_episode_rolls_out_on_gpt_oss_s_template():
    """gpt-oss: the model's channels become the structured message its template renders back, so the sampled ids
    and the template's render of the episode agree."""
    from jaxtune.environments import ToolEnvironment, rollout

    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = (TRL_TEMPLATES / "gptoss.jinja").read_text()
    turns = [' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>',
             "<|channel|>analysis<|message|>It said 5.<|end|><|start|>assistant<|channel|>final<|message|>5.<|return|>"]
    rounds = iter(turns)
    env = ToolEnvironment([env_tools.add], "harmony", reward=env_tools.answered)
    (episode,) = rollout([env], [{"prompt": "2 + 3?", "answer": "5"}], lambda prompts: [
        tokenizer.encode(next(rounds), add_special_tokens=False)], tokenizer, max_tokens=8192)
    assert episode.reward == 1.0 and episode.turns == 2
    assert episode.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert episode.messages[3] == {"role": "assistant", "content": "5.", "tool_calls": None, "thinking": "It said 5."}
    rendered = render_chat(episode.messages, tokenizer, tools=env.tools)
    assert tokenizer.decode(episode.example.ids, skip_special_tokens=False) == rendered
    env.close()
