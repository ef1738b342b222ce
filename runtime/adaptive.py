"""Adaptive speculation: per step, the plan's speculative step or a plain decode step (both precompiled),
whichever has recently emitted more tokens per second.

Whether speculation pays depends on the text (acceptance rises on repetitive or formulaic passages and
falls on free prose) and on the machine (what a verify pass costs against a decode step), so it is measured,
not predicted: each arm keeps an exponential average of its steps' tokens per second, the faster one runs,
and the slower one is retried every `probe` steps so its estimate follows the text. Only greedy steps
choose: for them both arms emit the same tokens, while a sampled step's random draws depend on the step
kind, and a seeded request must not depend on timing.
"""

from __future__ import annotations


class AdaptiveSpeculation:
    """A two-armed choice between speculating (True) and decoding plainly (False) by measured tokens/s."""

    def __init__(self, alpha: float = 0.25, probe: int = 16) -> None:
        self.alpha, self.probe = alpha, probe
        self.rate: dict[bool, float | None] = {True: None, False: None}
        self.steps: dict[bool, int] = {True: 0, False: 0}
        self._since_probe = 0

    def choose(self) -> bool:
        """Whether the next greedy step speculates: each arm once, then the faster, probing the other."""
        for arm in (True, False):
            if self.rate[arm] is None:
                return arm
        best = self.rate[True] >= self.rate[False]
        self._since_probe += 1
        if self._since_probe >= self.probe:
            self._since_probe = 0
            return not best
        return best

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A step of that kind emitted `tokens` (all rows together) in `seconds` of wall time."""
        r = tokens / max(seconds, 1e-9)
        old = self.rate[speculative]
        self.rate[speculative] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        self.steps[speculative] += 1
