"""Llama-family models: abstract parameters, the forward, Hugging Face import/export."""
