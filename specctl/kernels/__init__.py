"""specctl's hot loops: numba CPU kernels, C++ CPU kernels (bf16 linears, attention, GGUF quantized linears), and later optional GPU kernels beside a torch reference.

``specctl.kernels``, not a top-level ``kernels``: that import name is the Hugging Face Hub package, which
transformers (>= 5.25) installs as a dependency and which shadowed specctl's own top-level package of that
name in a fresh environment (tests/kernels/test_namespace.py checks that nothing imports it).
"""
