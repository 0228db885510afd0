"""specctl's hot loops: numba CPU kernels, C++ CPU kernels (bf16 linears, attention, GGUF quantized linears), and later optional GPU kernels beside a torch reference.

This is specctl's own ``kernels`` package, not the Hugging Face Hub package of the same import
name. transformers looks for that one (``is_kernels_available``) by version: it needs 0.18.x, and
this package reports specctl's own version through the ``specctl`` distribution, so transformers
never mistakes it for the Hub package (tests/kernels/test_namespace.py checks it).
"""
