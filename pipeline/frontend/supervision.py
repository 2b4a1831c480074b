"""How many engine-core deaths a front end restarts: `max_restarts` within a sliding
`window_s`; one more is a crash loop, and the engine is then left dead (as without
supervision). Shared by `AsyncLLM` (the server) and `LLMEngine` (`LLM(multiprocess=True)`)."""

from __future__ import annotations

import collections
import logging
import time

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 60.0


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float = DEFAULT_RESTART_WINDOW_S) -> None:
        self.max_restarts = max(0, max_restarts)
        self.window_s = window_s
        self._deaths: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        """Counts a death; True when it may be restarted, False in a crash loop."""
        if self.max_restarts == 0:
            return False
        now = time.monotonic()
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.max_restarts:
            logger.error(
                "engine core died %d times within %.0f s: a crash loop; not restarting it",
                len(self._deaths) + 1,
                self.window_s,
            )
            return False
        self._deaths.append(now)
        return True

    def exhaust(self) -> None:
        """No further restart (one failed to start)."""
        self._deaths.extend([time.monotonic()] * self.max_restarts)
