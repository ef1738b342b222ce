"""Output: a step's tokens into text, stops (EOS, stop strings, the budget) and finished results."""

from __future__ import annotations

import time
from typing import Any

from specair.runtime.params import GenerationResult, StreamEvent
from specair.runtime.scheduler import Seq


def eos_ids(target: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a sequence: the model config's and the tokenizer's."""
    return frozenset(set(target.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ()))


class Output:
    def __init__(self, eos_ids: frozenset[int]) -> None:
        self.eos_ids = eos_ids

    def emit(self, s: Seq, new: list[int], draft: tuple[int, int] | None = None) -> tuple[list[int], StreamEvent]:
        """Append a step's tokens to a sequence, stopping at EOS, a stop string or the budget; returns the
        tokens taken (a prefix of `new`) and the stream event."""
        taken, delta = [], ""
        for tok in new:
            s.out.append(tok)
            taken.append(tok)
            delta += s.text.add(tok)
            if tok in self.eos_ids and not s.params.ignore_eos or s.text.stopped:
                s.finish = "stop"
                break
            if len(s.out) >= s.budget:
                s.finish = "length"
                break
        s.tokens.extend(taken)
        if s.finish is None:
            return taken, StreamEvent(delta, taken, None, s.request_id, draft)
        ev = self.finish(s, s.finish)
        ev.text, ev.token_ids, ev.draft = delta + ev.text, taken, draft
        return taken, ev

    def finish(self, s: Seq, reason: str) -> StreamEvent:
        """The last event of a request, carrying its GenerationResult."""
        s.finish = reason
        t_end = time.perf_counter()
        tail = s.text.finish()
        n = len(s.out)
        extra: dict[str, Any] = {}
        if s.stats:
            st = dict(s.stats)
            st["mean_accepted_length"] = (st["num_accepted_tokens"] + st["num_drafts"]) / max(st["num_drafts"], 1)
            extra["spec"] = st
        t_first = s.t_first or t_end
        result = GenerationResult(
            text=s.text.text, token_ids=list(s.out), num_prompt_tokens=len(s.prompt), num_generated_tokens=n,
            finish_reason=reason, ttft_s=t_first - s.t0,
            decode_tokens_per_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
            prefill_tokens_per_s=len(s.prompt) / (t_first - s.t0) if t_first > s.t0 else 0.0,
            num_cached_tokens=s.cached, extra=extra)
        return StreamEvent(tail, [], result, s.request_id)

    def fail(self, s: Seq, error: BaseException) -> StreamEvent:
        """The last event of a request the engine failed on alone (finish reason "error")."""
        ev = self.finish(s, "error")
        ev.result.extra["error"] = f"{type(error).__name__}: {error}"
        return ev

    @staticmethod
    def count_draft(s: Seq, depth: int, accepted: int) -> None:
        """Speculation counters of one verify step: `depth` drafted, `accepted` of them kept."""
        st = s.stats
        st["num_drafts"] += 1
        st["num_draft_tokens"] += depth
        st["num_accepted_tokens"] += accepted
        for j in range(accepted):
            st["accepted_per_position"][j] += 1
