"""`SpecDecoder`: the public entry point. It turns prompts into `Sequence`s, runs one method over
them, and returns outputs in input order, with run statistics in `.stats`.

Which methods exist, and the runner of each, is `methods.METHODS`.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from tqdm.auto import tqdm

from . import diskcache, linears, methods, tp, tree
from .config import LOOKUP_FIRST, EngineConfig, SamplingParams, model_proposer
from .detok import StopStrings
from .errors import BatchspecError
from .models import ModelPair, load_pair
from .proposer import DraftProposer, EagleProposer, LookupFirst, NgramProposer
from .sampling import request_seed
from .sequence import GenerationOutput, Sequence
from .speculation import Adaptive, Fixed
from .stats import Stats
from .step import Context


class SpecDecoder:
    """Batched speculative decoding over a target/draft pair.

    >>> dec = SpecDecoder.from_pretrained(pair="tiny", method="exspec", k=4, batch_size=8)
    >>> outs = dec.generate(["Why is the sky blue?"], SamplingParams(max_new_tokens=16))
    >>> outs[0].token_ids, dec.stats.summary()["tokens_per_s"]
    """

    def __init__(self, pair: ModelPair, config: EngineConfig | None = None, **config_kw):
        self.pair = pair
        self.config = config if config is not None else EngineConfig(**config_kw)
        if config is not None and config_kw:
            raise BatchspecError("give either an EngineConfig or keyword options, not both")
        self.proposer = self._make_proposer()
        self.stats = Stats(device=str(pair.device))
        self.speculation = None  # built on first use: `auto` probes the machine's costs
        self.startup = dict(pair.startup)  # load_s, weights; tuning_s, tuning once measured

    @classmethod
    def from_pretrained(cls, pair=None, target=None, draft=None, dtype="float32", device=None, **config_kw):
        """Load a pair (see `models.load_pair`) and build a decoder; keywords go to EngineConfig."""
        config = EngineConfig(**config_kw)  # validate before the (slow) load
        return cls(load_pair(pair=pair, target=target, draft=draft, dtype=dtype, device=device), config)

    def _make_proposer(self):
        pair = self.pair
        name = self.config.proposer or pair.default_proposer
        self.proposer_name = name if self.config.speculative else None
        if not self.config.speculative:
            return None
        if name.startswith(LOOKUP_FIRST):  # lookup where it matches, the model elsewhere
            if methods.get(self.config.method).broken:
                raise BatchspecError(
                    f"method {self.config.method!r} cannot run --proposer {name}: its batch keeps rejected "
                    "drafts in the caches, which the combined proposer must rewind; use draft, eagle or ngram"
                )
            return LookupFirst(self._model_proposer(model_proposer(name)), NgramProposer(pair.vocab_size))
        return self._model_proposer(name)

    def _model_proposer(self, name: str):
        pair = self.pair
        if name == "ngram":
            return NgramProposer(pair.vocab_size)
        if name == "eagle":
            return self._eagle_proposer()
        if pair.draft is None:
            raise BatchspecError(
                f"pair {pair.name!r} has no draft model; use the n-gram proposer (--proposer ngram) or give --draft"
            )
        if pair.draft_vocab_ids is None and pair.draft.config.vocab_size != pair.vocab_size:
            raise BatchspecError(
                f"tokenizer mismatch: the target's vocabulary has {pair.vocab_size} entries, the draft's "
                f"{pair.draft.config.vocab_size}"
            )
        proposer = DraftProposer(pair.draft, pair.vocab_size, pair.draft_vocab_ids, self.config.branches)
        if tree.is_tree(self.config.branches):
            if methods.get(self.config.method).broken:
                raise BatchspecError(f"method {self.config.method!r} verifies chains only; use --branches 1")
            proposer.rewinds = True  # most of a tree's tokens are never in the draft's cache: re-fed next step
        return proposer

    def _eagle_proposer(self) -> EagleProposer:
        pair = self.pair
        if pair.head is None:
            raise BatchspecError(
                f"pair {pair.name!r} has no draft head (--proposer eagle): the built-in pairs ship one "
                "(not under --tp yet); choose --proposer draft or ngram"
            )
        if methods.get(self.config.method).broken:
            raise BatchspecError(
                f"method {self.config.method!r} cannot run the draft head (--proposer eagle): its batch keeps "
                "rejected drafts in the caches, which the head cannot rewind; use draft or ngram"
            )
        return EagleProposer(pair.head, pair.vocab_size, self.config.branches)

    def make_sequences(
        self, prompts: list, params: SamplingParams | list[SamplingParams], chat_template: bool = True
    ) -> list[Sequence]:
        """Validate and encode prompts; one Sequence each, in input order."""
        if isinstance(prompts, (str, bytes)):
            prompts = [prompts]
        if not prompts:
            raise BatchspecError("no prompts given")
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise BatchspecError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        context = self.pair.context_len
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            ids = self.pair.encode(prompt, chat_template)
            if len(ids) >= context:
                raise BatchspecError(
                    f"prompt {i} has {len(ids)} tokens, which leaves no room in the model's context of {context} tokens"
                )
            seqs.append(
                Sequence(
                    index=i,
                    prompt_ids=ids,
                    max_len=min(len(ids) + p.max_new_tokens, context),
                    eos_ids=frozenset() if p.ignore_eos else self.pair.eos_ids,
                    seed=None if p.greedy else request_seed(p.seed),
                    params=p,
                )
            )
        return seqs

    def generate(
        self,
        prompts: list,
        params: SamplingParams | list[SamplingParams] | None = None,
        chat_template: bool = True,
    ) -> list[GenerationOutput]:
        """Decode every prompt (text, or a list of token ids); outputs come back in input order."""
        params = params if params is not None else SamplingParams()
        seqs = self.make_sequences(prompts, params, chat_template)
        texts = StopStrings(self.pair.decode, seqs)
        self.run(seqs, observe=texts.observe if texts.active else None)
        return [self._output(seq, prompts[seq.index], texts.text(seq)) for seq in seqs]

    def run(self, seqs: list[Sequence], observe=None) -> Stats:
        """Run the configured method over prepared sequences (in place), each with its own
        SamplingParams; `observe` is the output processor (step.Context). Returns the stats."""
        cfg = self.config
        tp.sync_seeds(seqs)  # tensor-parallel ranks sample alike (no-op in one process)
        self.stats = Stats(device=str(self.pair.device))
        bar = tqdm(total=len(seqs), desc=cfg.method, unit="seq", disable=not cfg.progress, leave=False)
        ctx = Context(
            target=self.pair.target,
            proposer=self.proposer,
            k=cfg.k_max,
            speculation=self._speculation(),
            pad_id=self.pair.pad_id,
            device=self.pair.device,
            stats=self.stats,
            on_finish=lambda done: bar.update(len(done)),
            observe=observe,
        )
        if cfg.check_invariants:
            from .invariants import check_batch

            ctx.check = partial(check_batch, models=ctx.models())
        runner = methods.get(cfg.method).run()
        with torch.inference_mode(), self.stats.run():
            runner(ctx, seqs, cfg)
        bar.close()
        self.stats.extra["startup"] = dict(self.startup)
        describe = getattr(ctx.speculation, "describe", None)  # what `auto` measured and learned
        if describe is not None:
            self.stats.extra["speculation"] = describe()
        unfinished = [s.index for s in seqs if not s.finished]
        assert not unfinished, f"method {cfg.method} left sequences unfinished: {unfinished}"
        return self.stats

    def prepare(self, plain: bool = False) -> None:
        """Take now the measurements the first run would take (or find them in the cache); `plain`:
        for plain decoding only (the target's linear layers, no policy)."""
        if not plain and self.speculation is not None:
            return  # prepared already
        started, before = time.perf_counter(), diskcache.tally.copy()
        if plain:
            make_speculation(self.config, self.pair.target, None)
        else:
            self.speculation = make_speculation(self.config, self.pair.target, self.proposer)
        self.startup |= {"tuning_s": round(time.perf_counter() - started, 3), "tuning": _tuning(before)}

    def _speculation(self):
        """The speculation policy, kept across runs (what `auto` learned carries over)."""
        if self.speculation is None:
            self.prepare()
        return self.speculation

    def _output(self, seq: Sequence, prompt, text: str | None) -> GenerationOutput:
        return GenerationOutput(
            index=seq.index,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(seq.prompt_ids),
            token_ids=seq.generated,
            text=self.pair.decode(seq.generated) if text is None else text,
            finish_reason=seq.finish_reason,
            accepted_per_step=list(seq.accepted_per_step),
            logprobs=None if seq.logprobs is None else seq.logprobs[: len(seq.generated)],
        )


def _tuning(before) -> str:
    """How the machine's measurements went since `before` (a diskcache.tally copy)."""
    new = diskcache.tally - before
    if not new["measured"]:
        return "cached" if new["cached"] else "none"
    return "measured" if not new["cached"] else "partly cached"


def make_speculation(config: EngineConfig, target, proposer):
    """`Fixed(k)`, or `Adaptive` for k = "auto" (probes the costs of a batch of `batch_size` rows).
    First the models' linear layers measure every row count a step can feed them (linears.py)."""
    rows = config.batch_size * (config.k_max + 1)
    for model, most in ((target, max(rows, linears.LARGE)), (getattr(proposer, "model", None), rows)):
        if model is not None:  # the target's prefill chunks reach the largest bucket
            linears.prepare(model, most)
    if config.k == "auto" and proposer is not None:
        return Adaptive(target, proposer, config.batch_size, config.k_max)
    return Fixed(config.k_max)
