"""Drafters behind one `Proposer` base class, and the factory the engine calls."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.spec_decode.proposers.base import Draft, ProposeContext, Proposer


def make_proposer(config: SpeculativeConfig, runner, remote_drafter=None):
    """Build the proposer for `config.method` on the target runner's device, its greedy trees'
    ranking temperature set (`SpeculativeConfig.tree_temperature`; None: the drafter folder's
    calibration, for native MTP the target's folder, where its layers live). With
    `remote_drafter` (a drafter pool's client, engine/spec_decode/remote.py) the draft model named by
    `config.model` drafts in that pool instead of on this device (method "draft", chains only)."""
    if remote_drafter is not None:
        if config.method != "draft" or config.uses_tree:
            raise ValueError(
                f"a remote drafter pool drafts with a draft model, in chains: needs method 'draft' and "
                f"tree_nodes 0, got method {config.method!r}, tree_nodes {config.tree_nodes}"
            )
        from engine.spec_decode.remote import RemoteDrafterProposer

        return RemoteDrafterProposer(remote_drafter, runner, config.model)
    proposer = _make(config, runner)
    if proposer.supports_tree and config.uses_tree:
        from engine.spec_decode.proposers.tree_drafting import read_tree_temperature

        folder = runner.model_dir if config.method == "mtp" else config.model
        proposer.tree_temperature = (config.tree_temperature if config.tree_temperature is not None
                                     else read_tree_temperature(folder))
    return proposer


def _make(config: SpeculativeConfig, runner):
    if config.method == "ngram":
        from engine.spec_decode.proposers.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max, config.tree_width if config.uses_tree else 1)
    if config.method == "draft":
        from engine.spec_decode.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(config.model, runner, config.draft_vocab_size, config.tree_width)
    if config.method == "eagle":
        from engine.spec_decode.proposers.eagle import EagleProposer

        return EagleProposer(config.model, runner, config.draft_vocab_size, config.num_speculative_tokens,
                             config.tree_width)
    if config.method == "eagle3":
        from engine.spec_decode.proposers.eagle3 import Eagle3Proposer

        return Eagle3Proposer(config.model, runner, config.num_speculative_tokens, config.tree_width, config.draft_weights)
    if config.method == "medusa":
        from engine.spec_decode.proposers.medusa import MedusaProposer

        return MedusaProposer(config.model, runner, config.draft_vocab_size)
    if config.method == "mtp":
        from engine.spec_decode.proposers.mtp import MTPProposer

        return MTPProposer(config.model, runner, config.draft_vocab_size, config.num_speculative_tokens,
                           config.tree_width)
    raise ValueError(f"unknown speculative method {config.method!r}")


__all__ = ["Draft", "ProposeContext", "Proposer", "make_proposer"]
