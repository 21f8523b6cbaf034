"""Multi-turn environments with tools: tool calls read per family (malformed ones as values), tools run in a process
with a time limit (a raise, a hang, bad output, a crash: one line each, and the episode goes on), schemas equal to
transformers' `get_json_schema`, and episodes as ids with the loss on the model's own tokens only."""

import json
import time
from pathlib import Path

import env_tools
import pytest

from jaxtune.data.formats import load_sft_examples, render_chat
from jaxtune.data.tokenizer import Tokenizer, byte_level_backend, load_tokenizer
from jaxtune.environments import (
    Environment,
    EpisodeTokens,
    ToolCall,
    ToolCallError,
    ToolEnvironment,
    ToolRunner,
    detect_family,
    json_schema,
    load_environment,
    load_environments,
    parse_tool_calls,
    render_episode,
    rollout,
)
from jaxtune.errors import JaxtuneError

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
MARKERS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def template_tokenizer(name: str) -> Tokenizer:
    """Our tokenizer over the byte-level vocabulary with the template's markers as special tokens."""
    backend = byte_level_backend()
    backend.add_special_tokens(MARKERS)
    eos = {"qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
    bos = backend.token_to_id("<|begin_of_text|>") if name == "llama3" else None
    return Tokenizer(backend, bos, backend.token_to_id(eos), None, (TEMPLATES / f"{name}.jinja").read_text())


# --- parsing ------------------------------------------------------------------------------------------------------

def test_hermes_calls_content_and_malformed_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    turn = parse_tool_calls(text, "hermes")
    assert turn.content == "Let me check."
    assert turn.calls == (ToolCall("get_weather", {"city": "Paris"}), ToolCall("add", {"a": 1, "b": 2}))
    assert parse_tool_calls("Paris is sunny.", "qwen").calls == ()
    bad = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
                           '<tool_call>{"arguments": {}}</tool_call>'
                           '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
                           '<tool_call>["add"]</tool_call><tool_call>{"name": "add"', "hermes")
    assert all(isinstance(c, ToolCallError) and "\n" not in c.message for c in bad.calls)
    assert [c.message for c in bad.calls] == [
        "error: tool call 1 is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 38)",
        'error: tool call 2 has no "name" (expected {"name": ..., "arguments": {...}})',
        "error: the arguments of tool call 3 (add) must be a JSON object, got list",
        "error: tool call 4 must be a JSON object, got list",
        "error: tool call 5: <tool_call> is not closed by </tool_call> and what follows it is not a JSON object"]
    assert bad.calls[2].name == "add" and bad.valid == ()
    cut = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', "hermes")
    assert cut.calls == (ToolCall("add", {"a": 1, "b": 2}),)  # left open at the turn's end, as vLLM takes it


def test_llama3_json_python_tag_and_malformed_calls():
    one = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "llama3")
    assert one.calls == (ToolCall("get_weather", {"city": "Paris"}),) and one.content == ""
    two = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                           '{"name": "get_weather", "arguments": {"city": "Rome"}}<|eom_id|>', "llama3")
    assert two.calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("get_weather", {"city": "Rome"}))
    builtin = parse_tool_calls('<|python_tag|>brave_search.call(query="weather in Paris")', "llama3")
    assert builtin.calls == (ToolCall("brave_search", {"query": "weather in Paris"}),)
    assert parse_tool_calls("The sum is 3.", "llama3") == parse_tool_calls("The sum is 3.", "llama3")
    assert parse_tool_calls("The sum is 3.", "llama3").calls == ()
    (broken,) = parse_tool_calls('{"name": "add", "parameters": {"a": 1', "llama3").calls
    assert isinstance(broken, ToolCallError) and broken.message.startswith("error: tool call 1 is not valid JSON")
    (nameless,) = parse_tool_calls('{"parameters": {"a": 1}}', "llama3").calls
    assert nameless.message == 'error: tool call 1 has no "name" (expected {"name": ..., "parameters": {...}})'
    (code,) = parse_tool_calls("<|python_tag|>import os; os.remove('x')", "llama3").calls
    assert isinstance(code, ToolCallError) and "neither JSON nor name.call" in code.message


def test_harmony_channels_recipients_and_malformed_calls():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>')
    turn = parse_tool_calls(text, "harmony")
    assert turn.reasoning == "Need the weather." and turn.content == ""
    assert turn.calls == (ToolCall("get_weather", {"city": "Paris"}),)
    in_role = parse_tool_calls('<|start|>assistant to=functions.add<|channel|>commentary json<|message|>'
                               '{"a": 1, "b": 2}<|call|>', "gpt-oss")
    assert in_role.calls == (ToolCall("add", {"a": 1, "b": 2}),)
    final = parse_tool_calls("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                             "<|message|>It is 3.<|return|>", "harmony")
    assert (final.content, final.reasoning, final.calls) == ("It is 3.", "Easy.", ())
    (bad,) = parse_tool_calls("<|channel|>commentary to=functions.add <|constrain|>json<|message|>{a: 1}<|call|>",
                              "harmony").calls
    assert isinstance(bad, ToolCallError) and bad.name == "add"
    assert bad.message.startswith("error: tool call 1 (add) is not valid JSON")
    with pytest.raises(ValueError, match="'mistral' is not one of hermes, qwen, llama3, harmony, gpt-oss, xml"):
        parse_tool_calls("", "mistral")


def test_xml_and_glm_calls_typed_by_the_tools_schemas():
    tools = [json_schema(env_tools.get_weather)]
    text = ("I will look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    turn = parse_tool_calls(text, "xml", tools)
    assert turn.content == "I will look." and turn.calls == (ToolCall("get_weather", {"city": "2024", "days": 2}),)
    assert parse_tool_calls(text, "qwen3_coder").calls == (ToolCall("get_weather", {"city": 2024, "days": 2}),)
    (open_function, no_function) = parse_tool_calls("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>"
                                                    "</tool_call><tool_call>add</tool_call>", "xml").calls
    assert open_function == ToolCallError("error: tool call 1 (add): <function=add> is not closed by </function>",
                                          "add")
    assert no_function.message == "error: tool call 2 has no <function=NAME> inside <tool_call>"
    glm = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
           "<arg_value>3</arg_value>\n</tool_call><tool_call><arg_key>x</arg_key></tool_call>")
    call, nameless = parse_tool_calls(glm, "glm", tools).calls
    assert call == ToolCall("get_weather", {"city": "Paris", "days": 3})
    assert nameless.message == "error: tool call 2 has no function name after <tool_call>"


def test_the_family_is_read_from_real_chat_templates():
    families = {name: detect_family((TEMPLATES / f"{name}.jinja").read_text())
                for name in ("qwen2_5", "qwen3", "llama3", "gemma3", "mistral")}
    assert families == {"qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3", "gemma3": None, "mistral": None}
    assert detect_family("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"


# --- schemas ------------------------------------------------------------------------------------------------------

@pytest.mark.reference
@pytest.mark.parametrize("tool", [env_tools.add, env_tools.get_weather, env_tools.search, env_tools.boom,
                                  env_tools.a_set])
def test_schemas_equal_transformers_get_json_schema(tool):
    from transformers.utils import get_json_schema

    assert json_schema(tool) == get_json_schema(tool)


def test_schema_errors_name_the_tool_and_argument():
    def untyped(x):
        """No types.

        Args:
            x: something
        """

    def undocumented(x: int):
        """No Args section."""

    def custom(x: Path):
        """A custom class.

        Args:
            x: a path
        """

    for function, message in ((untyped, "tool untyped: argument 'x' has no type hint"),
                              (undocumented, "tool undocumented: argument 'x' is not described"),
                              (custom, "tool custom: argument 'x': type <class 'pathlib.Path'> has no JSON schema"),
                              (lambda x: x, "tool <lambda>: no docstring")):
        with pytest.raises(JaxtuneError, match=message.replace("(", r"\(").replace(")", r"\)")):
            json_schema(function)


# --- the tool process ---------------------------------------------------------------------------------------------

def test_a_raise_a_hang_bad_output_and_a_crash_are_one_line_each_and_the_runner_goes_on():
    with ToolRunner([env_tools.add, env_tools.boom, env_tools.sleep_forever, env_tools.a_set, env_tools.crash,
                     "env_tools:get_weather"], timeout_s=0.5) as runner:
        assert runner.call("add", {"a": 2, "b": 3}) == "5"
        assert runner.call("boom", {"x": 1}) == "error: tool 'boom' raised ValueError: no luck with 1"
        started = time.monotonic()
        assert runner.call("sleep_forever", {}) == "error: tool 'sleep_forever' did not finish within 0.5s and " \
                                                   "was stopped"
        assert time.monotonic() - started < 2.0  # the limit, the kill; not a tool left running
        stopped = runner._process
        assert stopped is None  # killed, not left running
        assert runner.call("a_set", {}) == "error: tool 'a_set' returned a set, which is not JSON-serialisable"
        assert runner.call("crash", {}) == "error: tool 'crash''s process exited with code 3"
        assert runner.call("add", {"a": 1, "c": 2}).startswith("error: tool 'add' raised TypeError: ")
        assert runner.call("nope", {}) == ("error: no tool named 'nope' (tools: add, boom, sleep_forever, a_set, "
                                           "crash, get_weather)")
        assert json.loads(runner.call("get_weather", {"city": "Oslo"})) == {"city": "Oslo", "temperature": 21}
        process = runner._process
    assert not process.is_alive()


def test_a_tool_the_worker_cannot_import_is_refused_up_front_and_a_worker_that_cannot_start_is_one_line():
    with pytest.raises(JaxtuneError, match="tool 'local' cannot be sent to the tool process .* define it at module"):
        ToolRunner({"local": lambda: 1})
    with pytest.raises(JaxtuneError, match="tool 'env_tools.nothing' cannot be imported"):
        ToolRunner(["env_tools.nothing"])
    with pytest.raises(JaxtuneError, match="two tools named add: name them with a mapping"):
        ToolRunner([env_tools.add, "env_tools.add"])
    with ToolRunner([env_tools.add], start_s=0.001) as runner:  # no interpreter starts that fast
        assert runner.call("add", {"a": 1, "b": 2}) == "error: the tool process did not start within 0.001s"
        runner.start_s = 60
        assert runner.call("add", {"a": 1, "b": 2}) == "3"


def test_a_worker_that_cannot_start_is_one_line_and_closes(monkeypatch):
    """The new interpreter dying before it is started (a broken pipe: e.g. a script without a main guard that the
    spawned interpreter re-runs) is the call's error line; closing the runner afterwards raises nothing."""
    runner = ToolRunner([env_tools.add])

    class Broken(runner._context.Process):
        def start(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(runner._context, "Process", Broken)
    assert runner.call("add", {"a": 1, "b": 2}) == ("error: the tool process could not start (BrokenPipeError: "
                                                     "[Errno 32] Broken pipe)")
    runner.close()


# --- the environment ----------------------------------------------------------------------------------------------

def test_a_tool_episode_goes_on_past_every_failure_and_ends_with_the_reward():
    env = load_environment("tools", tools=[env_tools.add, env_tools.boom, env_tools.sleep_forever, env_tools.a_set],
                           family="hermes", reward="env_tools.answered", timeout_s=0.5, system="Use tools.")
    assert isinstance(env, Environment) and isinstance(env, ToolEnvironment)
    assert [t["function"]["name"] for t in env.tools] == ["add", "boom", "sleep_forever", "a_set"]
    first = env.reset({"prompt": "What is 2 + 3?", "answer": "5"})
    assert first == [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2 + 3?"}]
    started = time.monotonic()
    calls = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in (
        {"name": "boom", "arguments": {"x": 1}}, {"name": "sleep_forever", "arguments": {}},
        {"name": "a_set", "arguments": {}}, {"name": "missing", "arguments": {}}))
    replies, reward, done = env.step(calls + "<tool_call>{oops}</tool_call><|im_end|>")
    assert time.monotonic() - started < 5.0 and not done and reward == 0.0  # a hang cut at 0.5s, a fresh worker
    assert [(r["name"], r["content"]) for r in replies] == [
        ("boom", "error: tool 'boom' raised ValueError: no luck with 1"),
        ("sleep_forever", "error: tool 'sleep_forever' did not finish within 0.5s and was stopped"),
        ("a_set", "error: tool 'a_set' returned a set, which is not JSON-serialisable"),
        ("missing", "error: no tool named 'missing' (tools: add, boom, sleep_forever, a_set)"),
        (None, "error: tool call 5 is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
               "column 2)")]
    assert env.messages[2] == {"role": "assistant", "content": calls + "<tool_call>{oops}</tool_call>"}
    replies, reward, done = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert replies == [{"role": "tool", "name": "add", "content": "5"}] and not done
    assert env.step("It is 5.") == ([], 1.0, True)
    assert [m["role"] for m in env.messages] == ["system", "user", "assistant", *["tool"] * 5, "assistant", "tool",
                                                 "assistant"]
    env.close()


def test_a_batch_of_tool_environments_shares_one_worker_until_the_last_closes():
    """`load_environments("tools", n)` (what a rollout batch builds): one worker process for the batch, not one an
    episode; it stops at the n-th close. An environment without `many` is built n times."""
    envs = load_environments("tools", 3, tools=[env_tools.worker_pid], family="hermes")
    call = '<tool_call>{"name": "worker_pid", "arguments": {}}</tool_call>'
    pids = set()
    for env in envs:
        env.reset({"prompt": "pid?"})
        pids.add(env.step(call).messages[0]["content"])
    assert len(pids) == 1 and len({id(env.runner) for env in envs}) == 1
    envs[0].close(), envs[1].close()
    assert envs[2].runner._process is not None and envs[2].runner._process.is_alive()
    envs[2].close()
    assert envs[2].runner._process is None
    plain = load_environments("grpo_environments.TwoTurns", 2, turns=3)
    assert len({id(env) for env in plain}) == 2 and all(env.turns == 3 for env in plain)


def test_an_episode_stops_after_max_turns_and_environments_load_by_path():
    env = load_environment("jaxtune.environments.tool_env:ToolEnvironment", tools={"plus": "env_tools.add"},
                           family="llama3", max_turns=1)
    assert env.tools[0]["function"]["name"] == "plus"
    env.reset({"messages": [{"role": "user", "content": "1 + 1?"}]})
    assert env.step('{"name": "plus", "parameters": {"a": 1, "b": 1}}') == (
        [{"role": "tool", "name": "plus", "content": "2"}], 0.0, True)
    env.close()
    with pytest.raises(JaxtuneError, match="environment 'maze': not one of tools, nor a dotted path"):
        load_environment("maze")
    with pytest.raises(JaxtuneError, match="tool-call family 'yaml'"):
        load_environment("tools", tools=[], family="yaml")


# --- episodes for the loss ----------------------------------------------------------------------------------------

CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
EPISODE = [{"role": "user", "content": "What is 2 + 3, then times 4?"},
           {"role": "assistant", "content": CALL_TEXT},
           {"role": "tool", "name": "add", "content": "5"},
           {"role": "assistant", "content": "Now times 4: 20."}]


def trained_text(tokenizer, example) -> list[str]:
    runs, current = [], []
    for token, m in zip(example.ids, example.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs + ([current] if current else [])]


def test_the_episode_mask_covers_the_model_turns_only_and_sampled_ids_give_the_same_episode():
    tokenizer = template_tokenizer("qwen2_5")
    tools = [json_schema(env_tools.add)]
    example = render_episode(EPISODE, tokenizer, tools)
    assert tokenizer.decode(example.ids, skip_special_tokens=False) == render_chat(EPISODE, tokenizer, tools=tools)
    assert trained_text(tokenizer, example) == [EPISODE[1]["content"] + "<|im_end|>", "Now times 4: 20.<|im_end|>"]

    episode = EpisodeTokens(EPISODE[:1], tokenizer, tools)
    assert tokenizer.decode(episode.prompt_ids, skip_special_tokens=False) == render_chat(
        EPISODE[:1], tokenizer, add_generation_prompt=True, tools=tools)
    for turn, replies in ((EPISODE[1], [EPISODE[2]]), (EPISODE[3], None)):
        episode.add_model_turn(tokenizer.encode(turn["content"] + "<|im_end|>", add_special_tokens=False), turn)
        if replies:
            episode.add_environment_turn(replies)
    ids = list(example.ids[:-1])  # the render's last "\n" after <|im_end|> is not sampled
    assert tokenizer.decode(example.ids[-1:]) == "\n"
    assert episode.example().ids == tuple(ids) and episode.example().loss_mask == example.loss_mask[:-1]

    qwen3 = template_tokenizer("qwen3")  # a template that re-spaces the reasoning block the model wrote
    rewritten = EpisodeTokens(EPISODE[:1], qwen3, tools)
    sampled = qwen3.encode("<think>Add first.</think>" + CALL_TEXT + "<|im_end|>", add_special_tokens=False)
    rewritten.add_model_turn(sampled, {"role": "assistant", "content": "<think>Add first.</think>" + CALL_TEXT})
    rewritten.add_environment_turn([EPISODE[2]])
    assert qwen3.decode(rewritten.ids[len(rewritten.ids) - rewritten.loss_mask[::-1].index(1):],
                        skip_special_tokens=False) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                                       "<|im_end|>\n<|im_start|>assistant\n")

    cut = EpisodeTokens(EPISODE[:1], tokenizer, tools)  # a turn cut short of its end token: the end comes masked
    cut.add_model_turn(tokenizer.encode(EPISODE[1]["content"], add_special_tokens=False), EPISODE[1])
    cut.add_environment_turn([EPISODE[2]])
    assert tokenizer.decode(cut.ids, skip_special_tokens=False) == render_chat(
        EPISODE[:3], tokenizer, add_generation_prompt=True, tools=tools)
    assert trained_text(tokenizer, cut.example()) == [EPISODE[1]["content"]]


def test_a_batch_of_episodes_rolls_out_on_the_sampled_ids_with_their_rewards():
    tokenizer = template_tokenizer("qwen2_5")
    script = [[CALL_TEXT, "It is 6."], ["It is 5."]]  # what the model writes, round by round, for those running
    prompts_seen = []

    def sample(prompts):
        prompts_seen.append(len(prompts))
        texts = script[len(prompts_seen) - 1]
        return [tokenizer.encode(text + "<|im_end|>", add_special_tokens=False) for text in texts]

    envs = [ToolEnvironment([env_tools.add], "hermes", reward=env_tools.answered) for _ in range(2)]
    record = {"prompt": "What is 2 + 3?", "answer": "5"}
    first, second = rollout(envs, [record, record], sample, tokenizer, max_tokens=4096)
    assert prompts_seen == [2, 1] and (first.reward, first.turns, second.reward, second.turns) == (1.0, 2, 0.0, 1)
    rendered = render_chat(first.messages, tokenizer, tools=envs[0].tools)
    assert tokenizer.decode(first.example.ids, skip_special_tokens=False) == rendered.removesuffix("\n")
    assert trained_text(tokenizer, first.example) == [CALL_TEXT + "<|im_end|>", "It is 5.<|im_end|>"]
    assert first.messages[2] == {"role": "tool", "name": "add", "content": "5"}

    prompts_seen.clear()  # a token budget the first turn and its reply fill: cut, and scored 0
    budget = len(first.example.ids) - len(tokenizer.encode("It is 5.<|im_end|>", add_special_tokens=False))
    cut, _ = rollout(envs, [record, record], sample, tokenizer, max_tokens=budget)
    assert cut.truncated and cut.reward == 0.0 and cut.turns == 1 and prompts_seen == [2]
    for env in envs:
        env.close()


# A Hermes-style template short enough for a quick run (the Qwen2.5 one's tool preamble is 700 bytes).
SHORT_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_sft_trains_on_tool_records_with_a_tool_template(tmp_path):
    """`objective = "sft"` on a JSONL of tool-calling records: the loss covers the tool calls and answers, and the run
    lowers the held-out loss."""
    from jaxtune.presets import write_random_model
    from jaxtune.run_config import load_run_config
    from jaxtune.train.loop import fine_tune

    model = write_random_model(tmp_path / "model", "llama", seed=0, initializer_range=0.1)
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = SHORT_TOOL_TEMPLATE
    tokenizer.save(model)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    records = [{"messages": [{"role": "user", "content": f"{n} + 3?"}, {"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "name": "add", "content": str(n + 3)},
                             {"role": "assistant", "content": f"{n + 3}."}], "tools": [json_schema(env_tools.add)]}
               for n in range(8)]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "run.toml"
    (example, *_), _ = load_sft_examples(data, load_tokenizer(model), 256)
    assert trained_text(tokenizer, example) == ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                                                "<|im_end|>", "3.<|im_end|>"]
    config.write_text(f'[model]\npath = "{model}"\n[method]\nkind = "lora"\nrank = 4\n[data]\ntrain = "{data}"\n'
                      f'max_seq_len = 256\neval_fraction = 0.25\n[train]\noutput_dir = "{tmp_path / "run"}"\n'
                      'max_steps = 4\nbatch_size = 2\nlearning_rate = 1e-2\neval_every = 4\ncheckpoint_every = 0\n')
    fine_tune(load_run_config(config), log=lambda _: None)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval_loss"] for r in evals if "eval_loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]
