"""ringllm.ipc: the shared-memory transport, and nothing above it.

Segments (shm.py, instance.py), ring layouts (layout.py), SPSC / broadcast rings (ring.py,
reader.py, writer.py), the MPSC request ring (mpsc.py), waiting (wait.py and the C
extension), liveness (liveness.py), record packing (packer.py) and the transport's errors
(errors.py). It imports nothing from the engine (tests/test_layers.py holds that): the
engine's own records and clients live with the engine, in ringllm.pipeline.engine.

The local IPC client moved to the engine's front end: `from ringllm.pipeline import Client`.
"""
