"""Vision towers beside the text decoder: each family's image preprocessing (numpy + Pillow, no torch), its vision
encoder as a pure function over a param pytree read from the checkpoint, and the positions its images take in the
text (Qwen2.5-VL's M-RoPE). Files are named by family: `qwen_vl_*.py`, `mrope.py`."""
