"""What a step costs, learned from the steps that ran: the scheduler's inter-token budget.

A step's wall time on a CPU grows with the tokens it computes: every step reads the
weights once (a fixed part, a) and multiplies them by each token's row (b per token), so

    seconds ~= a + b * tokens

fits it well (attention's share grows with context, and a window of recent steps follows
that drift). `StepCost` keeps the last `window` steps' (tokens, seconds) and fits a and b by
least squares. The scheduler asks it how many tokens fit in an inter-token target
(`tokens_within`) when a step carries both decoding requests, whose next token waits for
the whole step, and prompt tokens: those beyond the answer wait for the next step instead
of stalling every stream beside them (core/scheduler.py, "Decodes first").

No answer (None) until the window holds steps of different sizes (a line needs two
points apart) or when the fit makes no sense (b <= 0: noise, or a machine that got busy
mid-window): the scheduler then keeps its plain token budget.
"""

from __future__ import annotations

import collections
import math

WINDOW_STEPS = 64  # recent enough to follow a changing context length, enough to average
MIN_SPREAD_TOKENS = 8  # steps this far apart in size before a slope is trusted


class StepCost:
    def __init__(self, window: int = WINDOW_STEPS) -> None:
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._stale = False
        self._decode_steps: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, tokens: int, seconds: float, decodes_only: bool = False) -> None:
        """One executed step: the tokens it computed, its wall time, and whether every
        request in it computed one token (a step of decodes alone)."""
        if tokens > 0 and seconds > 0 and math.isfinite(seconds):
            self.samples.append((tokens, seconds))
            self._stale = True
            if decodes_only:
                self._decode_steps.append(seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds per step and per token, or None (see the module doc)."""
        if self._stale:
            self._stale = False
            self._fit = _least_squares(self.samples)
        return self._fit

    @property
    def decodes_alone_s(self) -> float | None:
        """The longest of the window's steps of decodes alone, as they ran: what
        `target_itl auto` multiplies. The longest, not the latest: when a wave of prompts
        arrives only a few requests may be decoding, and a target scaled to their small
        step would hold the prompts back just when most of the work is theirs (measured:
        a lower output rate and a later first token)."""
        return max(self._decode_steps) if self._decode_steps else None

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may compute and still take at most `seconds` (0 when
        even an empty step would not), or None when the cost is not known yet."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        return max(0, math.floor((seconds - a) / b + 1e-6))  # 1e-6: a float's last bits


def _least_squares(samples) -> tuple[float, float] | None:
    n = len(samples)
    if n < 2:
        return None
    xs = [t for t, _ in samples]
    if max(xs) - min(xs) < MIN_SPREAD_TOKENS:
        return None
    mx = sum(xs) / n
    my = sum(s for _, s in samples) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (s - my) for x, s in samples)
    b = sxy / sxx
    if not b > 0:
        return None
    return max(0.0, my - b * mx), b
