"""File formats and where files are, the ground floor's one room: safetensors, GGUF and JSON files read and written
as bytes, arrays and dicts, local or at a URL, with errors that name the file. Nothing here knows a model, a
tokenizer or a run; it stands on `errors.py` and `paths.py` (room on the disk before a write) only.

    safetensors.py   CheckpointReader (reads by slices), write_safetensors, write_weights (sharded, as HF does)
    gguf.py          llama.cpp's GGUF: is_gguf, gguf_reader (cached), metadata, tensors dequantised
    json.py          read_json
    storage.py       URLs (gs://, any fsspec URL): ranged reads, streamed files, a model's small files, run copies
"""
