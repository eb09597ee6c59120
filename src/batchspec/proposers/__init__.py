"""Where drafts come from: a draft model, the draft head reading the target's features, prompt
lookup, lookup first then a model (`make.make_proposer` builds one from options). Proposers return
draft ids and confidence bins; acceptance lives in core (`acceptance`, `tree`). Above the layouts,
whose caches they feed; below the policy and the engine, which call them."""
