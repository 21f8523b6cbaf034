"""Tiny Llama 4 vision-language files for tests: a character-level tokenizer holding Llama 4's special tokens
(`<|image_start|>`, `<|patch|>`, the tile separators, `<|image|>`, `<|image_end|>`, `<|header_start|>`...) with its
chat template as transformers' processor holds it, preprocessor_config.json (16-pixel tiles, at most 4 an image), and
`Llama4ForConditionalGeneration` made by transformers (a tiny MoE text model, 2 x 2 patches a tile) saved beside."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

from jaxtune.presets import CHARS

LLAMA4_SPECIAL = {"<|finetune_right_pad|>": 0, "<|begin_of_text|>": 1, "<|eot|>": 2, "<unk>": 3,
                  "<|header_start|>": 75, "<|header_end|>": 76, "<|image_start|>": 77, "<|image_end|>": 78,
                  "<|image|>": 79, "<|patch|>": 80, "<|tile_x_separator|>": 81, "<|tile_y_separator|>": 82}
PATCH, IMAGE_START, IMAGE_END = 80, 77, 78
# 16-pixel tiles of 4 x 4 patches of 4 pixels, shuffled to 2 x 2 soft tokens a tile
LLAMA4_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=16,
                     patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
                     vision_output_dim=48, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# two layers: a chunked rotating one (chunks of 8), then a NoPE one; mixtures of 4 experts, top 1, a shared expert
LLAMA4_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, intermediate_size_mlp=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=1, no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=8,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA4_PROCESSING = dict(image_processor_type="Llama4ImageProcessor", size={"height": 16, "width": 16}, max_patches=4,
                         resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3, rescale_factor=1 / 255)


def write_llama4_files(directory, template: bool = True) -> Path:
    """The tokenizer (characters, no merges, the special tokens whole; BOS `<|begin_of_text|>`, EOS `<|eot|>`) with
    (template) Llama 4's chat template as transformers' processor holds it, and preprocessor_config.json."""
    vocab = dict(LLAMA4_SPECIAL)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(LLAMA4_SPECIAL))
    backend.decoder = decoders.Fuse()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>",
              "pad_token": "<|finetune_right_pad|>", "unk_token": "<unk>"}
    if template:  # transformers' import brings torch
        from transformers.models.llama4.processing_llama4 import chat_template

        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(LLAMA4_PROCESSING))
    return directory


def write_llama4_model(directory, seed: int = 0):
    """A random float32 `Llama4ForConditionalGeneration` (`hf_models.randomize`) saved by `save_pretrained` with
    `write_llama4_files`' tokenizer and processor settings; returns the model, in eval mode."""
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Llama4Config(text_config=LLAMA4_TEXT, vision_config=LLAMA4_VISION,
                                       image_token_index=PATCH, boi_token_index=IMAGE_START, eoi_token_index=IMAGE_END)
    torch.manual_seed(seed)
    model = randomize(transformers.Llama4ForConditionalGeneration(config), seed)
    model.save_pretrained(directory)
    write_llama4_files(directory)
    return model.eval()
