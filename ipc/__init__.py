"""ringllm.ipc: shared-memory rings, record layouts, segment lifecycle, the local IPC client.

`from ringllm.ipc import Client` is resolved lazily, so the transport modules stay light to
import for code that only needs the rings.
"""


def __getattr__(name: str):
    if name == "Client":
        from ringllm.ipc.client import Client

        return Client
    raise AttributeError(f"module 'ringllm.ipc' has no attribute {name!r}")
