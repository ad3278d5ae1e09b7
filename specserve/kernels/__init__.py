"""Kernels: torch references (`reference`) and Triton implementations, dispatched by `ops` on the tensor's device."""
