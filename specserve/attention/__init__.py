"""Attention backends: eager metadata, graph-buffer metadata, and the paged attention itself."""
