"""The instance segment's last words: what an engine core that ends on purpose leaves for
the front ends that see it gone (the engine's HostLostError rides here)."""

from __future__ import annotations

from ringllm.ipc.instance import InstanceSegment


def test_last_words_reach_an_attached_reader_even_after_the_owner_closed():
    owner = InstanceSegment.create({"engine_pid": 1})
    reader = InstanceSegment.attach(owner.name)
    try:
        assert reader.note() is None
        owner.publish_note({"error": "HostLostError", "message": "host 1 was lost at 12:00"})
        owner.close()  # unlinked: the reader's mapping still holds it
        assert reader.note() == {"error": "HostLostError", "message": "host 1 was lost at 12:00"}
        assert reader.info() == {"engine_pid": 1}
    finally:
        reader.close()


def test_a_note_too_long_is_cut_to_fit():
    owner = InstanceSegment.create({"engine_pid": 1})
    try:
        owner.publish_note({"error": "HostLostError", "message": "x" * 5000})
        note = owner.note()
        assert note["error"] == "HostLostError" and note["message"] == "x" * 200
    finally:
        owner.close()
