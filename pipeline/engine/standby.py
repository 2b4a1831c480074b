"""A warm standby engine core: a spare process that has already paid for the interpreter
and its imports (torch and the engine, most of a core's start-up), waiting for a config.

    spawn()            python -m ...engine_core_proc --standby READY_FD   (imports, then
                       blocks reading one line on its stdin)
    activate(config)   the config JSON on its stdin -> it builds the engine core (model,
                       KV cache, rings) and reports ready: a RingCoreClient, as start() gives
    close()            SIGTERM: it leaves without having made anything (no segment, no model)

A supervising front end keeps one spare per core it may restart and, after using it,
spawns the next: a restart then costs the model load and the KV allocation only. What it
costs while it waits: one idle interpreter with torch imported (its RSS: README). It dies
with its parent (PR_SET_PDEATHSIG), like every engine child.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess

from ringllm.pipeline.child_process import child_env, start_child, stop_process
from ringllm.pipeline.config import EngineConfig, config_to_dict
from ringllm.pipeline.engine.ring_client import ENGINE_COMMAND, RingCoreClient

logger = logging.getLogger(__name__)


class StandbyCore:
    def __init__(self, process: subprocess.Popen, read_fd: int) -> None:
        self.process = process
        self._read_fd: int | None = read_fd

    @classmethod
    def spawn(cls) -> StandbyCore:
        read_fd, write_fd = os.pipe()
        try:
            process = start_child(
                [*ENGINE_COMMAND, "--standby", str(write_fd)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                env=child_env(),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls(process, read_fd)

    @property
    def usable(self) -> bool:
        return self._read_fd is not None and self.process.poll() is None

    def activate(self, config: EngineConfig) -> RingCoreClient:
        """The spare becomes the engine core for `config` (once only)."""
        if not self.usable:
            raise RuntimeError("the standby engine core is used or gone")
        read_fd, self._read_fd = self._read_fd, None
        try:
            self.process.stdin.write((json.dumps(config_to_dict(config)) + "\n").encode())
            self.process.stdin.close()
        except OSError as exc:  # it died meanwhile
            os.close(read_fd)
            stop_process(self.process)
            raise RuntimeError(f"the standby engine core is gone: {exc}") from None
        return RingCoreClient.when_ready(
            self.process, read_fd, config.multimodal.mm_transfer_mib << 20
        )

    def close(self) -> None:
        """An unused spare leaves (EOF on its stdin); a used one is its client's to stop."""
        if self._read_fd is None:
            return
        os.close(self._read_fd)
        self._read_fd = None
        try:
            self.process.stdin.close()
        except OSError:
            pass
        stop_process(self.process)  # SIGTERM: it holds nothing yet (imports at most)
