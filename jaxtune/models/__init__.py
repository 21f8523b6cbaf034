"""Llama-family models as pure functions: parameters declared before they exist (`params.py`), the forward
(`llama.py`, with its attention kernels, mixtures, chunked head and the hooks methods fill, `adapters.py`), decoding
with a KV cache, quantised frozen weights, and Hugging Face (and GGUF) checkpoints and configs in and out."""
