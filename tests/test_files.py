"""specctl.files: atomic writes leave the old content on failure, and files get the umask's mode."""

from __future__ import annotations

import stat

import pytest
import torch
from safetensors.torch import save_file

from specctl import files
from specctl.files import write_atomic, write_text_atomic


def test_weights_get_the_umask_mode_not_safetensors_0600(tmp_path):
    p = write_atomic(tmp_path / "model.safetensors", lambda t: save_file({"w": torch.zeros(2)}, str(t)))
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~files._UMASK
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert stat.S_IMODE(p.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)  # as open() makes a file


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    p = write_text_atomic(tmp_path / "a.json", "old")

    def broken(t):
        t.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(p, broken)
    assert p.read_text() == "old" and [f.name for f in tmp_path.iterdir()] == ["a.json"]


def test_a_file_written_elsewhere_gets_the_umask_mode(tmp_path):
    """What transformers' save_pretrained writes (safetensors: 0600) is given a plain file's mode."""
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(p))
    p.chmod(0o600)
    files.give_umask_mode(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~files._UMASK
