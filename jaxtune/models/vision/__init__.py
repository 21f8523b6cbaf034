"""Vision towers beside the text decoder: each family's image preprocessing (numpy + Pillow, no torch), its vision
encoder as a pure function over a param pytree read from the checkpoint, and where its images go in the text.
Gemma 3: `image_processing`, the SigLIP tower (`siglip`), the projector and image-text forward (`gemma3`), config
and weights (`hf`). Qwen2.5-VL: `qwen_vl_*` (processor, window layout, tower, config, weights) and M-RoPE (`mrope`)."""
