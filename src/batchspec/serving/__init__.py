"""The OpenAI-compatible server: `ServeConfig` (everything `serve` is told, checked before any model
loads; serving never reads argparse), the HTTP app over the online engine, access control, the
metrics, Ray Serve replicas."""
