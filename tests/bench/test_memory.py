"""A method's extra memory: the distinct tensor storages its proposer holds, less the target's."""

from __future__ import annotations

import torch

from specctl.bench.memory import tensor_bytes


def test_counts_weights_and_caches_once_and_leaves_out_the_target():
    target = torch.nn.Linear(64, 128, bias=False)  # 32 KiB of fp32

    class Slot:
        def __init__(self):
            self.k = torch.zeros(2, 100)  # 800 bytes
            self.view = self.k[:, :50]  # the same storage: not counted twice

    class Proposer:
        def __init__(self):
            self.head = torch.nn.Linear(64, 32, bias=False)  # 8 KiB: counted
            self.shared_lm_head = target.weight  # the target's: not counted
            self.slots = {0: Slot(), 1: Slot()}
            self.numbers = [1, 2.0, "x"]

    p = Proposer()
    assert tensor_bytes(p, (target,)) == 64 * 32 * 4 + 2 * 800
    assert tensor_bytes(p) == 64 * 32 * 4 + 2 * 800 + 64 * 128 * 4
    assert tensor_bytes(None) == 0
