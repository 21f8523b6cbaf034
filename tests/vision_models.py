"""Tiny vision-language files for tests, torch-free: character-level tokenizers holding Gemma 3's special tokens
(`<start_of_image>`, `<image_soft_token>`, `<end_of_image>`, turns) at the ids of the tiny model in
test_vision_gemma3.py and Qwen2.5-VL's (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|im_start|>`...) at
test_vision_qwen_vl_model.py's, with their chat templates as released (google/gemma-3-4b-it's, Qwen2.5-VL-Instruct's
as TRL ships it), and each model's config.json (Qwen2.5-VL's in the hub's layout) and preprocessor_config.json."""

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


def _write_backend(directory, special: dict[str, int]) -> Path:
    """tokenizer.json over a 96-token vocabulary: characters (no merges), the special tokens whole."""
    vocab = dict(special)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(special))
    backend.decoder = decoders.Fuse()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return directory


def write_gemma3_tokenizer(directory) -> None:
    """tokenizer.json and a tokenizer_config.json with the chat template and transformers' Gemma 3 image token
    attributes."""
    directory = _write_backend(directory, SPECIAL)
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


# Qwen2.5-VL-Instruct's chat template, as trl/chat_templates/qwen2_5_vl.jinja holds it
QWEN_VL_CHAT_TEMPLATE = (
    '{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for messa'
    "ge in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a"
    " helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['conten"
    "t'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'"
    "] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set im"
    'age_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}:'
    " {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'vi"
    "deo' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video"
    " {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' i"
    "n content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if "
    'add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
QWEN_SPECIAL = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3, "<|image_pad|>": 90,
                "<|video_pad|>": 91, "<|vision_start|>": 92, "<|vision_end|>": 93}
QWEN_IMAGE, QWEN_VISION_START, QWEN_VISION_END = 90, 92, 93
QWEN_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=16, out_hidden_size=32, fullatt_block_indexes=[1])
QWEN_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
QWEN_PROCESSING = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 64)


def write_qwen_vl_files(directory, config: bool = True) -> Path:
    """The tokenizer (EOS `<|im_end|>`, pad `<|endoftext|>`), preprocessor_config.json (4-pixel patches, at most
    48 x 64 pixels: 192 patches an image) and (config) config.json of a tiny Qwen2.5-VL, without weights."""
    directory = _write_backend(directory, QWEN_SPECIAL)
    if config:
        hf = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **QWEN_TEXT,
              "rope_theta": 1e4, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "vision_config": QWEN_VISION, "image_token_id": QWEN_IMAGE, "video_token_id": 91,
              "vision_start_token_id": QWEN_VISION_START, "vision_end_token_id": QWEN_VISION_END}
        (directory / "config.json").write_text(json.dumps(hf))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": "<unk>", "chat_template": QWEN_VL_CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    processing = {"image_processor_type": "Qwen2VLImageProcessor", **QWEN_PROCESSING}
    (directory / "preprocessor_config.json").write_text(json.dumps(processing))
    return directory
