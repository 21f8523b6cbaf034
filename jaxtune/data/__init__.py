"""Data: sources (JSONL, Parquet, Arrow, `save_to_disk`), tokenizers, instruction formats and their loss masks,
on-disk token stores and their cache, and packed fixed-shape batches."""
