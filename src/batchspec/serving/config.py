"""`ServeConfig`: everything `batchspec serve` is told, checked in one place before any model
loads. The command line builds one (cli.py); the server, the replicas and the tests take it, so
serving never reads argparse."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..core import tree
from ..core.config import EngineConfig
from ..core.errors import BatchspecError
from ..engine.threads import SPIN_MODES
from ..models.pair import PairSpec
from .access import Policy

#: The KV budget's share per row when none is given: batch size x min(context, this).
DEFAULT_KV_PER_ROW = 2048


#: --max-itl-ms by default: an iteration prefills only what keeps a running row's gap between two
#: steps under this (engine/admission.py; docs/serving.md, "Admission").
DEFAULT_MAX_ITL_MS = 500.0
#: --max-itl-steps by default: no bound in decode steps. At 2.5 steps the longest gaps at 2 clients
#: fell (392 and 311 ms against 548 and 579) but prefill spread over more, smaller forwards: 0.65x and
#: 0.56x the throughput at 8 and 16 synthetic clients, one round; with chunks carried in the step's
#: forward 0.85x and 0.81x, and 0.74-0.99x over 8 points (docs/serving.md, "Admission").
DEFAULT_MAX_ITL_STEPS = 0.0


@dataclass(frozen=True)
class ServeConfig:
    """The models, the engine and the server's own options. `no_spec`: plain decoding (k = 0) in
    the same engine. `prefix_cache_tokens` None: as many as the KV budget."""

    models: PairSpec = field(default_factory=PairSpec)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(batch_size=8))
    no_spec: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    arrival_window_ms: float = 50.0
    max_itl_ms: float = DEFAULT_MAX_ITL_MS  # the longest gap prefill may open between a running row's steps; 0: none
    max_itl_steps: float = DEFAULT_MAX_ITL_STEPS  # and at most this many decode steps; 0: no such bound
    spin: str = "auto"  # whether the OpenMP workers spin between products: threads.SPIN_MODES
    served_model_name: str | None = None
    prefix_cache: bool = True
    prefix_cache_tokens: int | None = None
    graceful_timeout: float = 30.0
    access: Policy = field(default_factory=Policy)
    replicas: int = 1
    replica_cpus: float = 1.0
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise BatchspecError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.arrival_window_ms <= 1000:
            raise BatchspecError(f"--arrival-window-ms must be between 0 and 1000, got {self.arrival_window_ms:g}")
        if not self.max_itl_ms >= 0:
            raise BatchspecError(f"--max-itl-ms must be >= 0 (0: no bound), got {self.max_itl_ms:g}")
        if not (self.max_itl_steps == 0 or self.max_itl_steps >= 1):
            raise BatchspecError(
                f"--max-itl-steps must be 0 (no bound) or >= 1 (the step itself), got {self.max_itl_steps:g}"
            )
        if self.spin not in SPIN_MODES:
            raise BatchspecError(f"--spin must be one of {', '.join(SPIN_MODES)}, got {self.spin!r}")
        budget = self.engine.kv_budget_tokens
        if budget is not None and budget < self.slots + 2:
            raise BatchspecError(f"--kv-budget must leave room for a prompt token and {self.slots + 1} draft slots")
        if self.prefix_cache_tokens is not None and (not self.prefix_cache or self.prefix_cache_tokens < 1):
            raise BatchspecError("--prefix-cache-tokens takes an integer >= 1 and does not go with --no-prefix-cache")
        if self.replicas < 1:
            raise BatchspecError(f"--replicas must be >= 1, got {self.replicas}")
        if not self.replica_cpus > 0:
            raise BatchspecError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.uses_ray and self.models.tp_size > 1:
            raise BatchspecError("--tp with --replicas or --ray-address is not supported; use one or the other")
        if self.uses_ray and importlib.util.find_spec("ray") is None:
            raise BatchspecError("--replicas and --ray-address need Ray Serve: pip install 'batchspec[ray]'")
        if self.access.max_bytes < 1:
            raise BatchspecError(f"--max-request-bytes must be >= 1, got {self.access.max_bytes}")
        if not self.access.body_timeout > 0:
            raise BatchspecError(f"--body-timeout must be > 0, got {self.access.body_timeout}")
        if self.access.metrics_auth and not self.access.keys:
            raise BatchspecError("--metrics-auth needs an API key (--api-key, --api-key-file or BATCHSPEC_API_KEY)")

    @property
    def uses_ray(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None

    @property
    def k(self) -> int:
        """The most drafts a row verifies per step: 0 under no_spec."""
        return 0 if self.no_spec else self.engine.k_max

    @property
    def slots(self) -> int:
        """Draft slots a step may write per row: k, or every node of a draft tree k deep."""
        return tree.columns(self.engine.branches, self.k)

    def kv_budget(self, context_len: int) -> int:
        """KV tokens all rows may reserve together: the given budget, or batch size x min(context, 2048)."""
        return self.engine.kv_budget_tokens or self.engine.batch_size * min(context_len, DEFAULT_KV_PER_ROW)
