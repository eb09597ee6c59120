"""`make_proposer`: the one place a proposer is built from options (the decoder, the server)."""

from __future__ import annotations

from ..core import methods, tree
from ..core.config import LOOKUP_FIRST, EngineConfig, model_proposer
from ..core.errors import BatchspecError
from ..models.pair import ModelPair
from .base import Proposer
from .draft import DraftProposer
from .eagle import EagleProposer
from .lookup_first import LookupFirst
from .ngram import NgramProposer


def make_proposer(
    pair: ModelPair, config: EngineConfig, chosen: str | None = None
) -> tuple[Proposer | None, str | None]:
    """(the proposer of `config` for `pair`, its name); (None, None) for a method that does not
    speculate. Where `config` names none: `chosen` (policy/drafter.py's choice for `--draft auto`),
    else the pair's default. Refuses, with a message naming the fix, a proposer the pair or method
    cannot run."""
    if not config.speculative:
        return None, None
    name = config.proposer or chosen or pair.default_proposer
    if pair.draft_quant is not None and model_proposer(name) != "draft":
        default = " (the pair's default)" if config.proposer is None else ""
        raise BatchspecError(
            f"--draft-quant {pair.draft_quant} quantizes the draft model, which --proposer {name}{default} "
            "does not run (lookup has no weights; the draft head is a few percent of a step and stays as it "
            "is): use --proposer draft or ngram+draft, or drop --draft-quant"
        )
    if name.startswith(LOOKUP_FIRST):  # lookup where it matches, the model elsewhere
        if methods.get(config.method).broken:
            raise BatchspecError(
                f"method {config.method!r} cannot run --proposer {name}: its batch keeps rejected "
                "drafts in the caches, which the combined proposer must rewind; use draft, eagle or ngram"
            )
        return LookupFirst(_model_proposer(pair, config, model_proposer(name)), NgramProposer(pair.vocab_size)), name
    return _model_proposer(pair, config, name), name


def _model_proposer(pair: ModelPair, config: EngineConfig, name: str) -> Proposer:
    if name == "ngram":
        return NgramProposer(pair.vocab_size)
    if name == "eagle":
        return _eagle_proposer(pair, config)
    if pair.draft is None:
        raise BatchspecError(
            f"pair {pair.name!r} has no draft model; use the n-gram proposer (--proposer ngram) or give --draft"
        )
    if pair.draft_vocab_ids is None and pair.draft.config.vocab_size != pair.vocab_size:
        raise BatchspecError(
            f"tokenizer mismatch: the target's vocabulary has {pair.vocab_size} entries, the draft's "
            f"{pair.draft.config.vocab_size}"
        )
    proposer = DraftProposer(pair.draft, pair.vocab_size, pair.draft_vocab_ids, config.branches)
    proposer.kv_from_target = pair.draft_copies_target
    if tree.is_tree(config.branches):
        if methods.get(config.method).broken:
            raise BatchspecError(f"method {config.method!r} verifies chains only; use --branches 1")
        proposer.rewinds = True  # most of a tree's tokens are never in the draft's cache: re-fed next step
    return proposer


def _eagle_proposer(pair: ModelPair, config: EngineConfig) -> EagleProposer:
    if pair.head is None:
        raise BatchspecError(
            f"pair {pair.name!r} has no draft head (--proposer eagle): the built-in pairs ship one "
            "(not under --tp yet); choose --proposer draft or ngram"
        )
    if methods.get(config.method).broken:
        raise BatchspecError(
            f"method {config.method!r} cannot run the draft head (--proposer eagle): its batch keeps "
            "rejected drafts in the caches, which the head cannot rewind; use draft or ngram"
        )
    return EagleProposer(pair.head, pair.vocab_size, config.branches)
