"""specctl: a toolkit for speculative decoding.

One lossless runtime (``specctl.runtime``) shared by every draft method, and the commands built on
it (``specctl.cli``). Heavy dependencies (torch, transformers) are imported lazily by the modules
that need them, so ``import specctl`` and ``specctl --help`` stay fast.
"""

__version__ = "0.1.0"
