"""Adaptive speculation: per step, a plain decode step or one of the plan's speculative shapes (all
precompiled), whichever has recently emitted the most tokens per second.

Whether speculation pays, and how deep and wide, depends on the text (acceptance rises on repetitive or
formulaic passages and falls on free prose) and on the machine (what a verify pass of T rows costs against
a decode step), so it is measured, not predicted: each arm keeps an exponential average of its steps'
tokens per second, the fastest one runs, and every `probe` steps one of the others runs instead (in turn),
so their estimates follow the text. Only greedy steps choose: for them every arm emits the same tokens,
while a sampled step's random draws depend on the step kind, and a seeded request must not depend on timing.
"""

from __future__ import annotations

from typing import Hashable, Sequence


class AdaptiveSpeculation:
    """A choice among arms by measured tokens/s; the engine's arms are its shapes 0..n-1 and None (plain
    decoding). Ties go to the earlier arm."""

    def __init__(self, arms: Sequence[Hashable], alpha: float = 0.25, probe: int = 16) -> None:
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ValueError(f"an adaptive choice needs two or more distinct arms, got {arms}")
        self.arms, self.alpha, self.probe = tuple(arms), alpha, probe
        self.rate: dict[Hashable, float | None] = {a: None for a in self.arms}
        self.steps: dict[Hashable, int] = {a: 0 for a in self.arms}
        self._since_probe = 0
        self._probes = 0

    def choose(self) -> Hashable:
        """The arm of the next greedy step: each arm once, then the fastest, probing the others in turn."""
        for arm in self.arms:
            if self.rate[arm] is None:
                return arm
        best = max(self.arms, key=lambda a: self.rate[a])
        self._since_probe += 1
        if self._since_probe >= self.probe:
            self._since_probe = 0
            others = [a for a in self.arms if a != best]
            self._probes += 1
            return others[(self._probes - 1) % len(others)]
        return best

    def record(self, arm: Hashable, tokens: int, seconds: float) -> None:
        """A step of that arm emitted `tokens` (all rows together) in `seconds` of wall time."""
        r = tokens / max(seconds, 1e-9)
        old = self.rate[arm]
        self.rate[arm] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        self.steps[arm] += 1
