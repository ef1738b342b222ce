"""N-gram prompt lookup (vLLM `ngram`, HF `prompt_lookup_num_tokens`): propose the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, n from `max_n` down to `min_n`.

The index is built as tokens arrive, so a proposal is a dictionary lookup per n, never a scan of the context.
"""

from __future__ import annotations


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram → where the tokens after its latest occurrence start."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens. An n-gram enters the index only once a token follows it, so the sequence's own
        suffix is never its own match."""
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending just before `t` now have a continuation at `end`
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix's latest earlier occurrence ([] if none)."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.tables[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []
