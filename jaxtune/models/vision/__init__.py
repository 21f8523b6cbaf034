"""Vision towers beside the text decoder, one `family.VisionFamily` unit each (`families.FAMILIES`): its image
preprocessing (numpy + Pillow, no torch), its vision encoder as a pure function over a param pytree read from the
checkpoint, and where its images go in the text. Gemma 3: `image_processing`, the SigLIP tower (`siglip`), the
projector and the unit (`gemma3`), config and weights (`hf`). Qwen2.5-VL: `qwen_vl_*` (processor, tower, config,
weights) and the unit (`qwen2_5_vl`: padded pixel arrays, M-RoPE positions in the step)."""
