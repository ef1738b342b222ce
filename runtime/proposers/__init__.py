"""Proposers, one file each; importing this package registers them (`base.PROPOSERS`)."""

from specair.runtime.proposers import draft_model, eagle, medusa, mlp_speculator, ngram  # noqa: F401 (registration)
from specair.runtime.proposers.base import (PROPOSERS, Proposal, Proposer, Step, parse_config, proposer_class,
                                            shipped_head)

__all__ = ["PROPOSERS", "Proposal", "Proposer", "Step", "parse_config", "proposer_class", "shipped_head"]
