"""The models and how they run: loading a pair (`pair`), the tiny pair built from configs, the draft
model and the draft head's network, the linear layers' and attention's kernels batchspec installs,
a model's forward (`forward`), sharding. Below the layouts: a model takes a layout's mask,
positions and cache as plain keyword arguments and knows nothing of how rows are stored."""
