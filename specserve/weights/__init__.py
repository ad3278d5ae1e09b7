"""Checkpoint readers: HF safetensors folders (single or sharded) and GGUF files."""
