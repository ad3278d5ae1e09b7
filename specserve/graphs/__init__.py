"""CUDA graphs: the one capture/replay skeleton, the padding contract, and the target phase runners."""
