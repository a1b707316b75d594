"""Command-line tools: train, smoke, features, validate (and more, see `megatron-rl --help`)."""
