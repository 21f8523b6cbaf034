"""Tiny Qwen2.5-VL files for tests, torch-free: a character-level tokenizer holding Qwen2.5-VL's special tokens
(`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|im_start|>`...) at the ids of the tiny model in
test_vision_qwen_vl_model.py, its chat template as released, config.json in the hub's layout and
preprocessor_config.json (Gemma 3's: `jaxtune.presets.write_gemma3_files`)."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

from jaxtune.presets import CHARS

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
    """The tokenizer (characters, no merges, the special tokens whole; EOS `<|im_end|>`, pad `<|endoftext|>`),
    preprocessor_config.json (4-pixel patches, at most 48 x 64 pixels: 192 patches an image) and (config)
    config.json of a tiny Qwen2.5-VL, without weights."""
    vocab = dict(QWEN_SPECIAL)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(QWEN_SPECIAL))
    backend.decoder = decoders.Fuse()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
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
