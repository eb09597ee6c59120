"""`SpecDecoder`: the public entry point. It turns prompts into `Sequence`s, runs one method over
them, and returns outputs in input order, with run statistics in `.stats`.

Which methods exist, and the runner of each, is `methods.METHODS`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from tqdm.auto import tqdm

from .core import methods
from .core.config import EngineConfig, SamplingParams
from .core.detok import StopStrings
from .core.errors import BatchspecError
from .core.sequence import GenerationOutput, Sequence
from .core.stats import Stats
from .distributed import tp
from .engine.step import Context
from .models import invariant
from .models.pair import ModelPair, load_pair
from .policy import drafter
from .policy.speculation import prepare
from .proposers.make import make_proposer


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
        self._apply_mode()
        self.choice = drafter.choose(pair, self.config)  # lookup, the copy or a user's draft, measured
        runs_on = drafter.pair_to_run(self.choice, pair)
        self.proposer, self.proposer_name = make_proposer(runs_on, self.config, self.choice and self.choice.proposer)
        self.stats = Stats(device=str(pair.device))
        self.speculation = None  # built on first use: `auto` probes the machine's costs
        self.startup = dict(pair.startup)  # load_s, weights; tuning_s, tuning once measured
        if self.choice is not None:
            self.startup["drafter"] = self.choice.why

    @classmethod
    def from_pretrained(cls, pair=None, target=None, draft=None, dtype="float32", device=None, **config_kw):
        """Load a pair (see `models.load_pair`) and build a decoder; keywords go to EngineConfig."""
        config = EngineConfig(**config_kw)  # validate before the (slow) load
        return cls(load_pair(pair=pair, target=target, draft=draft, dtype=dtype, device=device), config)

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
            seqs.append(Sequence.request(i, ids, p, context, self.pair.eos_ids, self.pair.matcher(p)))
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
        self._apply_mode()  # decoders of either mode may share the pair (bench --batch-invariant off,on)
        tp.sync_seeds(seqs)  # tensor-parallel ranks sample alike (no-op in one process)
        self.stats = Stats(device=str(self.pair.device))
        bar = tqdm(total=len(seqs), desc=cfg.method, unit="seq", disable=not cfg.progress, leave=False)
        ctx = Context.of(
            self.pair,
            self.proposer,
            cfg.k_max,
            self._speculation(),
            stats=self.stats,
            on_finish=lambda done: bar.update(len(done)),
            observe=observe,
        )
        if cfg.check_invariants:
            from .engine.invariants import check_batch

            adopted = (ctx.proposer.role,) if ctx.copies_target else ()
            ctx.check = partial(check_batch, models=ctx.models(), adopted=adopted)
        runner = methods.get(cfg.method).run()
        with torch.inference_mode(), self.stats.run():
            runner(ctx, seqs, cfg)
        bar.close()
        self.stats.extra["startup"] = dict(self.startup)
        if (described := ctx.speculation.describe()) is not None:  # what `auto` measured and learned
            self.stats.extra["speculation"] = described
        unfinished = [s.index for s in seqs if not s.finished]
        assert not unfinished, f"method {cfg.method} left sequences unfinished: {unfinished}"
        self._revise_drafter()
        return self.stats

    def _revise_drafter(self) -> None:
        """The choice ran a model (the copy, or a user's draft): where its drafts' acceptance on these
        prompts says the next best pays more (drafter.revise: the rival model, else lookup alone),
        the next run uses that; where `-k auto` hardly drafted with it (drafter.idle), lookup alone."""
        if self.choice is None or self.choice.costs is None or self.proposer_name != "draft":
            return
        rival = self.choice.rival
        why = drafter.revise(self.choice.costs, *self.speculation.acceptance(), self.choice.label, rival)
        if why is None and self.config.k == "auto":
            why, rival = drafter.idle(self.stats.chosen_k, self.choice.label), None
        if why is not None:
            self.choice = drafter.Choice("ngram", why) if rival is None else replace(rival, why=why, rival=None)
            runs_on = drafter.pair_to_run(self.choice, self.pair)
            self.proposer, self.proposer_name = make_proposer(runs_on, self.config, self.choice.proposer)
            self.speculation, self.startup["drafter"] = None, why

    def _apply_mode(self) -> None:
        """Put the target under the batch-invariant mode or take it out, as the config says."""
        invariant.apply(self.pair.target, self.config.batch_invariant)

    def prepare(self, plain: bool = False) -> None:
        """Take now the measurements the first run would take (or find them in the cache); `plain`:
        for plain decoding only (the target's linear layers, no policy)."""
        if not plain and self.speculation is not None:
            return  # prepared already
        speculation, report = prepare(self.config, self.pair.target, None if plain else self.proposer)
        if not plain:
            self.speculation = speculation
        self.startup |= report

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
