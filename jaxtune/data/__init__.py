"""Data: tokenizers, JSONL instruction formats, masking and batching."""
