"""The oracle: the target alone, one sequence at a time, with its own KV cache.

Deliberately plain: no padding, no masks, no position ids (the model counts them from the cache),
one token per forward. Greedy takes the argmax; sampling picks with the Gumbel noise of the token's
position under the request's seed (sampling.py), as every method does, so all of them agree with it
token for token under a seed. A request with a grammar picks among the tokens its grammar allows
next (the masked logits). Every other method is tested against this.
"""

from __future__ import annotations

import torch

from ..cache import kv
from ..core import grammar, logprobs
from ..core.sampling import choose, greedy, probabilities, row_noise
from ..core.sequence import Sequence
from ..engine.step import Context


@torch.inference_mode()
def generate_one(target, seq: Sequence, observe=None) -> None:
    """Decode `seq` to completion in place, with its own SamplingParams; `observe([seq])` after
    each token (the output processor: stop strings)."""
    params = seq.params
    cache = kv.reference_cache(target.config, full=True)  # sliding layers keep all too: one mask, any forward
    ids = torch.tensor([seq.token_ids], device=target.device)
    while True:
        logits = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        allowed = logits if seq.matcher is None else grammar.apply(logits, seq.matcher.mask())
        if params.greedy:
            token = int(greedy(allowed))
        else:
            noise = row_noise([seq], 1, logits.shape[-1], logits.device)[:, 0]
            token = int(choose(probabilities(allowed, params), noise))
        logprobs.record([seq], logits[:, None], [[0] * seq.commit([token])])
        if observe is not None:
            observe([seq])
        if seq.finished:
            return
        ids = torch.tensor([[token]], device=target.device)


def run(ctx: Context, seqs: list[Sequence], config) -> None:
    """Method `reference`: every sequence alone (the batch size is ignored)."""
    for seq in seqs:
        with ctx.stats.stage("verify"):
            generate_one(ctx.target, seq, ctx.observe)
        ctx.stats.tokens += len(seq.generated)
        ctx.stats.step_tokens += len(seq.generated) - 1
        ctx.stats.row_steps += len(seq.generated) - 1
        ctx.stats.steps += len(seq.generated) - 1
        ctx.stats.accepted_hist[0] += len(seq.generated) - 1
        ctx.on_finish([seq])
