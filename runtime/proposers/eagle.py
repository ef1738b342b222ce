"""EAGLE (and EAGLE-2 dynamic trees) and EAGLE-3: a one-layer head that drafts from the target's hidden
states (EAGLE-3: from three of its layers' features, which its plan's target graphs output instead).

Entry p of the head's cache pairs token p+1 with the target's hidden state at p, so it runs one entry
behind the target; the pending entries' hidden states come from the verify graph's accepted path (or
the plain decode step) and feed the next catch-up. Drafting itself is the draft model's loop
(`graphs.draft`) with the head's own output features extrapolated for drafted nodes.
"""

from __future__ import annotations

from typing import Any

from specair.models.eagle import load_eagle
from specair.models.eagle3 import load_eagle3
from specair.runtime.proposers.base import HeadProposer, register
from specair.runtime.proposers.draft_model import CachedDraft


@register
class Eagle(CachedDraft, HeadProposer):
    method = "eagle"
    offset = 1
    reads_hidden = True
    shipped = "eagle"

    loader = staticmethod(load_eagle)


@register
class Eagle3(Eagle):
    method = "eagle3"
    shipped = "eagle3"

    loader = staticmethod(load_eagle3)

    @classmethod
    def target_view(cls, target: Any, draft: Any) -> Any:
        from specair.models.llama import with_features

        return with_features(target, draft.feature_layers)
