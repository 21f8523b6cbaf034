"""Tiny Gemma 3 vision-language files for tests, torch-free: a character-level tokenizer holding Gemma 3's special
tokens (`<start_of_image>`, `<image_soft_token>`, `<end_of_image>`, turns) at the ids of the tiny model in
test_vision_gemma3.py, and Gemma 3's chat template as released (google/gemma-3-4b-it's)."""

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

# gemma-3-4b-it's chat_template.json
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")

SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<image_soft_token>": 90, "<start_of_image>": 91,
           "<end_of_image>": 92, "<start_of_turn>": 93, "<end_of_turn>": 94}
CHARS = "\n " + string.ascii_letters + string.digits + ".,?!:'-"  # ids 4 .. 74


def write_gemma3_tokenizer(directory) -> None:
    """tokenizer.json (characters, no merges; the special tokens whole) and a tokenizer_config.json with the chat
    template and transformers' Gemma 3 image token attributes, for a 96-token vocabulary."""
    vocab = dict(SPECIAL)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL))
    backend.decoder = decoders.Fuse()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": GEMMA3_CHAT_TEMPLATE,
              "extra_special_tokens": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                       "eoi_token": "<end_of_image>"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=512,
            rms_norm_eps=1e-5, sliding_window=3, model_type="gemma3_text",
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# 64-pixel images in 16-pixel patches: a 4 x 4 grid pooled to 2 x 2 soft tokens an image
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=64,
              patch_size=16, vision_use_head=False, model_type="siglip_vision_model")
IMAGE, BOI, EOI = 90, 91, 92


def write_gemma3_files(directory, pan_and_scan: bool = False) -> Path:
    """A tiny Gemma 3 VLM directory without weights: config.json, preprocessor_config.json, the tokenizer."""
    directory = Path(directory)
    write_gemma3_tokenizer(directory)
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": TEXT,
              "vision_config": VISION, "mm_tokens_per_image": 4, "image_token_index": IMAGE,
              "boi_token_index": BOI, "eoi_token_index": EOI, "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}
    (directory / "config.json").write_text(json.dumps(config))
    processing = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 64, "width": 64},
                  "do_pan_and_scan": pan_and_scan, "pan_and_scan_min_crop_size": 8,
                  "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 1.5}
    (directory / "preprocessor_config.json").write_text(json.dumps(processing))
    return directory
