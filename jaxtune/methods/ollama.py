"""An Ollama `Modelfile` beside an exported GGUF file (`ollama create NAME -f OUT.Modelfile`): FROM the file, the
chat template as the Go template Ollama renders (written out for the families whose turns it recognises by their
markers: Llama 3, ChatML — Qwen, SmolLM —, Gemma; a plain `role: content` one otherwise, said in a comment), the
default system prompt the chat template adds, `PARAMETER stop` for the end-of-turn and end-of-sequence tokens, and
the sampling defaults of generation_config.json (temperature 0 where it says do_sample false).

    write_modelfile(Path("out.gguf"), tokenizer, generation)  # -> out.Modelfile
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.io.json import read_json

# family -> (the marker its chat template has, Ollama's Go template, its end of turn, its default system turn)
FAMILIES: dict[str, tuple[str, str, str, str | None]] = {
    "llama3": ("<|start_header_id|>",
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
               "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
               "<|eot_id|>", r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "chatml": ("<|im_start|>",
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n",
               "<|im_end|>", r"<\|im_start\|>system\n(.*?)<\|im_end\|>"),
    "gemma": ("<start_of_turn>",
              '{{- range .Messages }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}user{{ end }}\n'
              "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
              "<end_of_turn>", None),
}
GENERIC = "{{- range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}assistant: "
# generation_config.json's sampling keys -> Ollama's PARAMETER names
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty"}


def chat_family(chat_template: str | None) -> str | None:
    """The family whose turn markers the chat template has, or None."""
    return next((name for name, (marker, *_) in FAMILIES.items() if chat_template and marker in chat_template), None)


def _default_system(tokenizer: Tokenizer, pattern: str | None) -> str | None:
    """The system prompt the chat template puts before a lone user message (SmolLM2's, Qwen2.5's), or None."""
    if pattern is None:
        return None
    text = render_chat([{"role": "user", "content": "\x00"}], tokenizer)
    match = re.search(pattern, text.split("\x00")[0], re.S)
    return match[1] if match else None


def _quoted(text: str) -> str:
    """A Modelfile argument: triple-quoted when it spans lines or holds a quote, else double-quoted."""
    return f'"""{text}"""' if "\n" in text or '"' in text else f'"{text}"'


def modelfile(gguf_name: str, tokenizer: Tokenizer, generation: dict) -> str:
    """The Modelfile text for the GGUF file `gguf_name` (beside it) of a model with `tokenizer` and the
    generation_config.json `generation` ({} when there is none)."""
    family = chat_family(tokenizer.chat_template)
    lines = [f"FROM ./{gguf_name}"]
    stops = []
    if family is None:
        lines.append("# TEMPLATE: generic (role: content turns); the model's own chat template, if any, is in the GGUF "
                     "file's tokenizer.chat_template" if tokenizer.chat_template else "# TEMPLATE: no chat template")
        lines.append(f"TEMPLATE {_quoted(GENERIC)}")
    else:
        _, template, end_of_turn, system = FAMILIES[family]
        lines += [f"# TEMPLATE: {family} (from the model's chat template)", f"TEMPLATE {_quoted(template)}"]
        default = _default_system(tokenizer, system)
        if default:
            lines.append(f"SYSTEM {_quoted(default)}")
        stops.append(end_of_turn)
    eos = generation.get("eos_token_id", tokenizer.eos_id)
    for i in eos if isinstance(eos, list) else [eos]:
        token = tokenizer.backend.id_to_token(i) if i is not None else None
        if token is not None and token not in stops:
            stops.append(token)
    lines += [f"PARAMETER stop {_quoted(s)}" for s in stops]
    if generation.get("do_sample") is False:
        lines.append("PARAMETER temperature 0")
    else:
        lines += [f"PARAMETER {name} {generation[key]}" for key, name in SAMPLING.items() if key in generation]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: Path, tokenizer: Tokenizer, generation_config: Path | None) -> Path:
    """`gguf_path` with suffix .Modelfile, for `ollama create NAME -f` it; `generation_config`: the model's
    generation_config.json, if it has one."""
    generation = read_json(generation_config) if generation_config and generation_config.is_file() else {}
    out = gguf_path.with_suffix(".Modelfile")
    out.write_text(modelfile(gguf_path.name, tokenizer, generation))
    return out
