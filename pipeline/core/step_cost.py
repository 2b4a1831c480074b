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

A decode token costs more than a prompt token: its attention reads its whole context, and it
gets an LM-head row and a sample. Where the engine says how many of a step's tokens were
decodes, `prompt_tokens_within` fits the two kinds apart,

    seconds ~= a + b_d * decodes + b_p * prompt tokens,

and answers how many prompt tokens fit beside a given number of decodes. One slope for both
let the steps that carried prompts beside the decodes pass the target: measured on an Intel
Xeon (2 cores), `serve` at concurrency 16, target 23.6 ms, those steps took 23-29 ms.

A least-squares line is the steps' mean: half of the steps it allows run past it. So the
answer keeps a margin, the MARGIN_QUANTILE-th of how far the window's steps with prompt
tokens ran past their fitted cost (`margin_s`), and most of them end within the target, not
half. Measured (Zen 5, `serve` at concurrency 16, a 26 ms target): those steps ran 2.3 ms
(90th percentile) and 4 ms (99th) past the fit, so their streams' P99 inter-token gap sat
at the target plus 4-8 ms.
"""

from __future__ import annotations

import collections
import math

import numpy as np

WINDOW_STEPS = 64  # recent enough to follow a changing context length, enough to average
MIN_SPREAD_TOKENS = 8  # steps this far apart in size before a slope is trusted
DECODES_ALONE_QUANTILE = 0.9  # of the window's steps of decodes alone: `decodes_alone_s`
MARGIN_QUANTILE = 0.9  # of the steps' overruns of the split fit: `margin_s`


class StepCost:
    def __init__(self, window: int = WINDOW_STEPS) -> None:
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._stale = False
        self.window = window
        self._steps = 0  # steps observed: a step of decodes alone is recent within `window`
        self._decode_steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        # (decodes, prompt tokens, seconds) of the steps whose decodes the engine counted
        self.split: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self._split_fit: tuple[float, float, float] | None = None
        self._margin = 0.0
        self._split_stale = False

    def observe(self, tokens: int, seconds: float, decodes: int | None = None) -> None:
        """One executed step: the tokens it computed, its wall time, and how many of its
        requests computed one token (decodes; None: not counted). A step whose every token
        is a decode is a step of decodes alone."""
        if tokens > 0 and seconds > 0 and math.isfinite(seconds):
            self.samples.append((tokens, seconds))
            self._stale = True
            self._steps += 1
            if decodes == tokens:
                self._decode_steps.append((self._steps, seconds))
            if decodes is not None and 0 <= decodes <= tokens:
                self.split.append((decodes, tokens - decodes, seconds))
                self._split_stale = True

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds per step and per token, or None (see the module doc)."""
        if self._stale:
            self._stale = False
            self._fit = _least_squares(self.samples)
        return self._fit

    @property
    def decodes_alone_s(self) -> float | None:
        """A long one of the window's steps of decodes alone, as they ran (the
        DECODES_ALONE_QUANTILE-th): what `target_itl` given as a multiple multiplies. A long
        one, not the latest: when a wave of prompts arrives only a few requests may be
        decoding, and a target scaled to their small step would hold the prompts back just
        when most of the work is theirs (measured: a lower output rate and a later first
        token). Not the longest: one slow step (the first after a pause, a thread the
        front end took its core from) then set the target for the whole window (measured,
        Intel Xeon, `serve` at concurrency 16: 17.3 ms against a 90th percentile of 11.5,
        so the steps that took prompts ran to 23-31 ms).

        Only the steps of decodes alone among the last `window` steps count: under a
        steady load many steps carry a prompt, and older ones (a server's first, colder
        steps) kept the target up long after (measured, Zen 5, `serve` at concurrency 16:
        the first run's 20-24 ms steps set a 34 ms target while the decodes ran in 15-18).
        With none of them recent, the split fit's cost of the window's most decodes alone."""
        oldest = self._steps - self.window
        recent = sorted(seconds for n, seconds in self._decode_steps if n > oldest)
        if recent:
            return recent[int(DECODES_ALONE_QUANTILE * (len(recent) - 1))]
        fit = self.split_fit()
        if fit is None:
            return None
        a, b_d, _ = fit
        return a + b_d * max(d for d, _, _ in self.split)

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may compute and still take at most `seconds` (0 when
        even an empty step would not), or None when the cost is not known yet."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        return max(0, math.floor((seconds - a) / b + 1e-6))  # 1e-6: a float's last bits

    def split_fit(self) -> tuple[float, float, float] | None:
        """(a, b_d, b_p): seconds per step, per decode and per prompt token, or None (too
        few steps with prompt tokens of different sizes, or a senseless slope)."""
        if self._split_stale:
            self._split_stale = False
            self._split_fit = _least_squares_split(self.split)
            self._margin = 0.0 if self._split_fit is None else _overrun(self.split, self._split_fit)
        return self._split_fit

    @property
    def margin_s(self) -> float:
        """How far a step with prompt tokens runs past the split fit: the MARGIN_QUANTILE-th
        of the window's overruns (0 without a split fit, or when the steps ran within it)."""
        self.split_fit()
        return self._margin

    def prompt_tokens_within(self, seconds: float, decodes: int) -> int | None:
        """The most prompt tokens a step beside `decodes` decodes may compute and still take
        at most `seconds` (0: none fit), from the split fit less its margin where it exists,
        else from the one-slope fit; None when the cost is not known yet."""
        fit = self.split_fit()
        if fit is None:
            total = self.tokens_within(seconds)
            return None if total is None else max(0, total - decodes)
        a, b_d, b_p = fit
        room = seconds - self._margin - a - b_d * decodes
        return max(0, math.floor(room / b_p + 1e-6))


def _least_squares_split(samples) -> tuple[float, float, float] | None:
    if len(samples) < 3:
        return None
    data = np.asarray(samples, dtype=np.float64)
    prompts = data[:, 1]
    if prompts.max() - prompts.min() < MIN_SPREAD_TOKENS:
        return None
    design = np.column_stack([np.ones(len(data)), data[:, 0], prompts])
    (a, b_d, b_p), *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    if b_d < 0:
        # the window's steps carried nearly the same number of decodes (a served load at
        # its concurrency), so their cost cannot be told from the fixed part: fit them as
        # part of it (measured: without this the split fit was refused in a whole `serve`
        # run at concurrency 16, 14-16 decodes a step, and the one slope answered)
        (a, b_p), *_ = np.linalg.lstsq(design[:, [0, 2]], data[:, 2], rcond=None)
        b_d = 0.0
    if not (b_p > 0 and math.isfinite(a)):
        return None
    return max(0.0, float(a)), float(b_d), float(b_p)


def _overrun(samples, fit: tuple[float, float, float]) -> float:
    """The MARGIN_QUANTILE-th of how far the steps with prompt tokens ran past `fit` (>= 0)."""
    a, b_d, b_p = fit
    over = [s - (a + b_d * d + b_p * p) for d, p, s in samples if p > 0]
    if not over:
        return 0.0
    over.sort()
    return max(0.0, over[int(MARGIN_QUANTILE * (len(over) - 1))])


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
