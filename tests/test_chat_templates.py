"""Loss masks of chat examples from the real chat templates models ship (tests/data/chat_templates, sources in
SOURCES.json): the trained tokens are exactly each assistant turn's output and the token that ends the turn, for one
turn, several turns and a system prompt, and the rendered text is transformers' `apply_chat_template`'s."""

import json
from pathlib import Path

import pytest
import transformers
from test_data import trained_runs, write_jsonl

from jaxtune.data.formats import load_sft_examples, render_chat
from jaxtune.data.tokenizer import Tokenizer, byte_level_backend
from jaxtune.errors import JaxtuneError

pytestmark = pytest.mark.reference

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SOURCES = json.loads((TEMPLATES / "SOURCES.json").read_text())
MARKERS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
           "<|im_sep|>", "<think>", "</think>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<s>", "</s>",
           "[INST]", "[/INST]", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>", "<pad>"]
# What ends an assistant turn in each template; Qwen3 writes an empty reasoning block before the final answer.
CLOSE = {"llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "mistral": "</s>",
         "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>", "phi4": "<|im_end|>"}
EMPTY_THOUGHT = {"qwen3": "<think>\n\n</think>\n\n"}
FINAL_EOS = {"phi3": "\n<|endoftext|>"}  # Phi-3's template closes the conversation with EOS after the last turn

SYSTEM = {"role": "system", "content": "You answer in one word."}
TURNS = [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "Paris."},
         {"role": "user", "content": "And of Italy?"},
         {"role": "assistant", "content": "Rome, of course."}]
CONVERSATIONS = {"single turn": TURNS[:2], "multi-turn": TURNS, "system prompt": [SYSTEM, *TURNS]}


def tokenizers(name: str):
    """(ours, transformers') over a byte-level vocabulary with the template's markers as special tokens."""
    source = SOURCES[name]
    backend = byte_level_backend()
    backend.add_special_tokens(MARKERS)
    template = (TEMPLATES / f"{name}.jinja").read_text()
    ids = {k: backend.token_to_id(source[k]) if source.get(k) else None
           for k in ("bos_token", "eos_token", "pad_token")}
    ours = Tokenizer(backend, ids["bos_token"], ids["eos_token"], ids["pad_token"], template)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template,
        **{k: source[k] for k in ("bos_token", "eos_token", "pad_token") if source.get(k)})
    return ours, theirs


def expected_runs(name: str, messages: list[dict]) -> list[str]:
    """Each assistant turn's output as the model writes it: the content, then the turn's end."""
    assistants = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = [content + CLOSE[name] for content in assistants]
    return runs[:-1] + [EMPTY_THOUGHT.get(name, "") + runs[-1] + FINAL_EOS.get(name, "")]


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(CLOSE))
def test_only_assistant_turns_and_their_end_carry_loss(name, conversation, tmp_path):
    ours, theirs = tokenizers(name)
    messages = CONVERSATIONS[conversation]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    try:
        rendered = theirs.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # the template refuses the conversation (Gemma 2: no system role)
        with pytest.raises(JaxtuneError, match=f"chat.jsonl:1: chat template: {e}"):
            load_sft_examples(path, ours, 512)
        assert conversation == "system prompt" and name == "gemma2"
        return
    assert render_chat(messages, ours) == rendered
    (example,), _ = load_sft_examples(path, ours, 512)
    assert ours.decode(example.ids, skip_special_tokens=False) == rendered
    runs = [ours.decode(run, skip_special_tokens=False) for run in trained_runs(example)]
    assert [run.strip(" ") for run in runs] == expected_runs(name, messages)


@pytest.mark.parametrize("name", list(CLOSE))
def test_generation_prompt_equals_transformers(name):
    ours, theirs = tokenizers(name)
    messages = TURNS[:3]
    assert render_chat(messages, ours, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_qwen3_trains_the_last_turns_reasoning_and_earlier_turns_answers(tmp_path):
    """Qwen3 in thinking mode: the template keeps the last assistant turn's <think> block and drops earlier ones',
    so the earlier turn trains its answer and end, the last one its reasoning, answer and end."""
    ours, theirs = tokenizers("qwen3")
    messages = [TURNS[0], {"role": "assistant", "content": "<think>\nIt is Paris.\n</think>\n\nParis."}, TURNS[2],
                {"role": "assistant", "content": "<think>\nItaly: Rome.\n</think>\n\nRome, of course."}]
    rendered = theirs.apply_chat_template(messages, tokenize=False)
    assert "It is Paris." not in rendered and "Italy: Rome." in rendered
    (example,), _ = load_sft_examples(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), ours, 512)
    assert ours.decode(example.ids, skip_special_tokens=False) == rendered
    runs = [ours.decode(run, skip_special_tokens=False) for run in trained_runs(example)]
    assert runs == ["Paris.<|im_end|>", "<think>\nItaly: Rome.\n</think>\n\nRome, of course.<|im_end|>"]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma2", "phi3"])
def test_prompt_completion_through_the_chat_template(name, tmp_path):
    """`[data] apply_chat_template = true`: a prompt/completion record (and an alpaca one, instruction and input as the
    user turn) is the chat record of a user and an assistant turn — transformers' render, the loss on the answer and
    its end — where without it the same record trains as raw text."""
    ours, theirs = tokenizers(name)
    records = [{"prompt": "What is the capital of France?", "completion": "Paris."},
               {"instruction": "Name the capital.", "input": "France", "output": "Paris."}]
    users = ["What is the capital of France?", "Name the capital.\n\nFrance"]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    as_chat, _ = load_sft_examples(path, ours, 512, as_chat=True)
    for example, user in zip(as_chat, users):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "Paris."}]
        (reference,), _ = load_sft_examples(write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}]), ours, 512)
        assert example == reference
        assert ours.decode(example.ids, skip_special_tokens=False) == theirs.apply_chat_template(messages,
                                                                                                 tokenize=False)
        assert [ours.decode(r, skip_special_tokens=False).strip(" ") for r in trained_runs(example)] == \
            expected_runs(name, messages)
    raw, _ = load_sft_examples(path, ours, 512)
    assert "What is the capital of France?Paris." in ours.decode(raw[0].ids, skip_special_tokens=False)
