"""Helpers shared by the bench tests."""

from __future__ import annotations

import time

import pytest

from specctl.config import SpecConfig
from specctl.runtime.proposers.ngram import NgramProposer


class SlowNgram(NgramProposer):
    """An n-gram draft that costs ``SLEEP_S`` a call, whatever it drafts; ``calls`` counts them."""

    SLEEP_S = 0.02

    def __init__(self, max_model_len: int = 128, k: int = 3):
        super().__init__(SpecConfig(method="ngram", num_speculative_tokens=k).validated(), max_model_len=max_model_len)
        self.calls = 0

    def propose(self, requests, ks):
        self.calls += 1
        time.sleep(self.SLEEP_S)
        return super().propose(requests, ks)


@pytest.fixture
def slow_ngram():
    return SlowNgram()
