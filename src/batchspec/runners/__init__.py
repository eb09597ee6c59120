"""One runner per decoding method, as `core.methods` names them: `run(ctx, seqs, config)` decodes
the sequences in place with the engine's steps over a layout."""
