"""A tiny random Gemma4ForConditionalGeneration for tests, saved by transformers: a character-level tokenizer holding
Gemma 4's image tokens (`<|image|>` the chat template writes, `<|image>` / `<image|>` around the soft tokens) at the
ids of the tiny config, a chat template writing `<|image|>` for an image part (as Gemma 4's does; its turn markup
simplified), preprocessor_config.json as `Gemma4ImageProcessorPil.save_pretrained` writes it (4-pixel patches,
70 soft tokens of 3 x 3 patches: 630 patches an image), float32 weights ~ N(0, 1/fan_in), clipped linears."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

from jaxtune.presets import CHARS

SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|image|>": 90, "<|image>": 91, "<image|>": 92,
           "<|turn>": 93, "<turn|>": 94, "<|audio|>": 95}
IMAGE, BOI, EOI = 90, 91, 92
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|image|>{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
# sliding, sliding, full (transformers makes the last full); per-layer inputs; images' spans on sliding layers
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=96, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0, use_bidirectional_attention="vision", pad_token_id=0, bos_token_id=2,
            eos_token_id=1, max_position_embeddings=1024)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=256, standardize=True,
              use_clipped_linears=True)
PROCESSING = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json (characters, no merges, the special tokens whole) and tokenizer_config.json with the chat
    template and Gemma 4's image token attributes."""
    vocab = dict(SPECIAL)
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<unused{i}>": i for i in range(96) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL))
    backend.decoder = decoders.Fuse()
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<turn|>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_gemma4_vl(directory, seed: int = 0, **text):
    """Save a random tiny Gemma4ForConditionalGeneration (`text` over TEXT) with its tokenizer and image processor
    into `directory`; returns the model (eval, float32)."""
    import numpy as np
    import torch
    import transformers
    from hf_models import randomize

    config = transformers.Gemma4Config(
        text_config=TEXT | text, vision_config=VISION, audio_config=None, image_token_id=IMAGE, boi_token_id=BOI,
        eoi_token_id=EOI, video_token_id=97, audio_token_id=98, boa_token_id=99,  # past the vocabulary: never text
        eoa_token_index=100)
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize(transformers.Gemma4ForConditionalGeneration(config), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():  # clip bounds that cut some values; standardisation of O(1)
            if name.endswith(("input_min", "output_min")):
                b.copy_(-1.0 - torch.rand((), generator=gen))
            elif name.endswith(("input_max", "output_max")):
                b.copy_(1.0 + torch.rand((), generator=gen))
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(1.0 / np.sqrt(32) * (1 + 0.1 * torch.randn(b.shape, generator=gen)))
        table = model.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(0.3 * torch.randn(table.shape, generator=gen))
    directory = Path(directory)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    transformers.Gemma4ImageProcessorPil(**PROCESSING).save_pretrained(directory)
    return model.eval()
