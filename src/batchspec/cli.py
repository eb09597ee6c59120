"""The `batchspec` command line: `generate`, `verify`, `bench`.

This module owns the command line: it parses, validates every option before the (slow) model
load, calls the library (`engine`, `bench`, `equivalence`), and prints. All commands share the
model options (--pair | --target/--draft, --dtype, --device) and the prompt options (--prompts
FILE, --limit N, positional prompts, --no-chat-template). Errors in input are printed as one line
naming the problem (exit status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys

from .core import diskcache, methods
from .core.config import AUTO_K_MAX, PROPOSERS, EngineConfig, SamplingParams
from .core.errors import BatchspecError
from .core.stats import startup_text
from .decoder import SpecDecoder
from .distributed import tp
from .engine.threads import BUSY_CORES, SPIN_MODES, SPIN_ROWS
from .models import compiled, invariant
from .models.pair import AUTO, DTYPES, MAX_AUTOTUNE, PAIRS, TUNE, PairSpec, target_config
from .models.quant import QUANTS
from .serving import access
from .serving.config import DEFAULT_MAX_ITL_MS, DEFAULT_MAX_ITL_STEPS, ServeConfig
from .tools import bench, equivalence
from .tools.prompts import Prompt, read_prompts

PROPOSER_HELP = (
    "draft model, n-gram lookup, the draft head reading the target's features, or lookup first and "
    "a model elsewhere (ngram+eagle, ngram+draft) (default: the pair's)"
)
BRANCHES_HELP = (
    "candidates verified per draft position: 1 = a chain (default); C > 1 drafts a tree of C nodes per "
    "depth (the model proposer's C most likely continuations at each depth), verified in one forward; "
    "C1xC2x.. (e.g. 4x2x1): C_d nodes at depth d, the last repeated below"
)
K_HELP = (
    "draft tokens per row and step: N, or auto (default: chosen every step from measured costs, "
    f"0..{AUTO_K_MAX} per row)"
)
INVARIANT_HELP = (
    "the target's logits the same bits alone or in any batch, so output equals the target alone's in "
    "bfloat16 too (CPU; docs/batch-invariance.md)"
)
DEFAULT_PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is speculative decoding?"]


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--pair", choices=PAIRS, help="built-in pair (default: default, unless --target is given)")
    g.add_argument("--target", help="target model: a local HF directory, a .gguf file, or a hub id")
    g.add_argument(
        "--draft",
        help="draft model (same forms): it runs where the measured costs favour it over the n-gram proposer "
        "alone and the target's own int4 copy (built beside it with memory to spare; --proposer draft or "
        "--draft-quant runs it as asked); or self: the target's own weights, quantized (--draft-quant); or "
        "auto (the default beside --target unless --proposer ngram or eagle): self or the n-gram proposer "
        "alone, whichever the measured costs at the batch size favour (self only with memory to spare)",
    )
    g.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="float32 (default: exact) or bfloat16 (fast)"
    )
    g.add_argument(
        "--draft-dtype",
        choices=list(DTYPES),
        help="the draft model's and draft head's own precision (default: --dtype; for --draft self, bfloat16 "
        "where the device computes it natively); the output does not depend on it",
    )
    g.add_argument(
        "--draft-quant",
        choices=list(QUANTS),
        help="the draft model's linear layers weight-only quantized (default: int4, its LM head int8, for "
        "--draft self on a CPU, else none); the output does not depend on it",
    )
    g.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        metavar="N|full",
        help="the draft model's LM head scores at most N tokens: those it is fed, learned as it runs (with a "
        "large vocabulary the head is most of a small draft's step; default: 32768 for --draft self, else "
        "full); the output does not depend on it",
    )
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    compiling = g.add_mutually_exclusive_group()
    compiling.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        default=None,
        help="run the target's decoder eager, op by op (default: one compiled graph where the model's layers "
        "allow it, or --max-autotune's packages where they were made for this model before, e.g. by `batchspec "
        "tune`; the built-in tiny pairs run eager)",
    )
    compiling.add_argument(
        "--max-autotune",
        dest="compile",
        action="store_const",
        const=MAX_AUTOTUNE,
        help="compile the target with its weights frozen into the graph and its products in inductor's C++ GEMM "
        "kernels, tuned for this CPU: faster steps, for about 3 minutes of compiling on a first start (later ones "
        "load the compiled packages from the tuning cache in seconds, and so do later default starts) and packed "
        "copies of the weights (docs/benchmarks.md)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="shard the target over N processes with transformers' tensor-parallel plan (started with "
        "torch.distributed.run unless already under torchrun; docs/scale-out.md)",
    )
    g = p.add_argument_group("start-up (what is measured or converted once is kept on disk)")
    g.add_argument(
        "--tuning-cache",
        metavar="DIR",
        help=f"the cache directory: machine measurements and converted GGUF files (default: ${diskcache.ENV}, "
        "else $XDG_CACHE_HOME/batchspec, else ~/.cache/batchspec)",
    )
    g.add_argument("--no-tuning-cache", action="store_true", help="measure and convert afresh; read and write no cache")


def _prompt_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("prompt", nargs="*", help="prompts (default: a few built-in ones)")
    g.add_argument(
        "--prompts", metavar="FILE", help="Spec-Bench JSONL (first turn) or a text file, one prompt per line"
    )
    g.add_argument("--limit", type=int, help="use only the first N prompts of --prompts")
    g.add_argument(
        "--every",
        type=int,
        default=1,
        help="take every N-th prompt of --prompts (spreads a sample over Spec-Bench's categories)",
    )
    g.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")


def _decode_options(p: argparse.ArgumentParser, one_method: bool) -> None:
    g = p.add_argument_group("decoding")
    if one_method:
        g.add_argument(
            "--method",
            choices=methods.names(),
            default=methods.DEFAULT_METHOD,
            help=f"(default: {methods.DEFAULT_METHOD})",
        )
        g.add_argument("--batch-size", type=int, default=8)
    if one_method:
        g.add_argument("-k", type=k_value, default="auto", help=K_HELP)
    else:
        g.add_argument("-k", default="auto", help=K_HELP + "; a comma-separated list runs each value (bench)")
    g.add_argument("--proposer", choices=list(PROPOSERS), help=PROPOSER_HELP)
    if one_method:
        g.add_argument("--branches", type=branches_value, default=1, help=BRANCHES_HELP)
    else:
        list_help = BRANCHES_HELP + "; a comma-separated list runs each value (bench)"
        g.add_argument("--branches", default="1", help=list_help)
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128; verify: 48)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, help="per-request seed (sampling)")
    g.add_argument("--window-size", type=int, help="exspec: active pool size (default 4 x batch size)")
    g.add_argument(
        "--min-group", type=int, help="exspec: smallest same-length group run unpadded (default: batch size)"
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        help="ragged: prompt tokens prefilled per step while rows decode (default: all that fits, offline)",
    )
    g.add_argument(
        "--kv-budget",
        type=int,
        dest="kv_budget_tokens",
        help="ragged: KV tokens all rows may reserve together (default: the largest requests of one batch)",
    )
    g.add_argument(
        "--check-invariants", action="store_true", help="check every synchronization invariant after each step (slow)"
    )
    if one_method:
        g.add_argument("--batch-invariant", action="store_true", help=INVARIANT_HELP)
    else:
        g.add_argument(
            "--batch-invariant",
            nargs="?",
            const="on",
            default="off",
            metavar="off,on",
            help=INVARIANT_HELP + "; bench takes 'off,on' (both, paired by repeat)",
        )
    g.add_argument("--json", metavar="OUT", help="write a machine-readable result to OUT")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchspec", description="Batched speculative decoding, done right.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode prompts with one method and print the text and stats")
    for add in (_model_options, _prompt_options):
        add(gen)
    _decode_options(gen, one_method=True)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="keep each token's log-probability under the target and its N likeliest alternatives "
        "(0..20): the mean is printed, every entry goes to --json",
    )
    shape = gen.add_argument_group("structured output (one of them; every prompt's output follows it)")
    shape.add_argument(
        "--json-schema", metavar="FILE", help="a JSON schema file: the output is a JSON value it accepts"
    )
    shape.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="a Lark grammar file: the output is a sentence of it")
    correct = ",".join(m for m in methods.names(include_broken=False) if methods.get(m).speculative)
    verify = _comparison(
        sub, "verify", "compare methods with the target alone and explain every divergence", correct, cmd_verify
    )
    verify.set_defaults(max_new_tokens=48)
    timed = ",".join(m for m in methods.names(include_broken=False) if m != "reference")
    b = _comparison(sub, "bench", "time every method side by side, with the speed-of-light model", timed, cmd_bench)
    b.add_argument("--repeats", type=int, default=1, help="runs of each method, interleaved (default 1)")
    b.add_argument("--plot", metavar="OUT.png", help="write the throughput / stage plot")
    _serve_parser(sub)
    _tune_parser(sub)
    return parser


def _tune_parser(sub) -> None:
    """`batchspec tune`: load a pair and measure what a decoder would at its first run, into the cache."""
    p = sub.add_parser(
        "tune",
        help="convert the models and measure this machine once, into the cache (e.g. in a container build)",
        description="Load the pair (a GGUF is converted once) and take the measurements a decoder takes when it "
        "starts (linear-layer formulations, and with -k auto the step-cost probes) for each batch size, so that "
        "later generate/serve/bench runs with the same options start without measuring. On a CPU it also "
        "compiles the target with --max-autotune (about 3 minutes on 2 cores for the default pair; --no-compile or "
        "BATCHSPEC_COMPILE=graph skip it, and so does a model whose packed weight copies, about twice its "
        "decoder's bytes, pass a quarter of the memory available): later default starts load those tuned "
        "kernels from the cache.",
    )
    _model_options(p)
    g = p.add_argument_group("decoding (as the later runs will use them)")
    g.add_argument("--batch-sizes", default="8", help="comma-separated batch sizes to measure for (default 8)")
    g.add_argument("-k", type=k_value, default="auto", help=K_HELP)
    g.add_argument("--proposer", choices=list(PROPOSERS), help=PROPOSER_HELP)
    g.add_argument("--branches", type=branches_value, default=1, help=BRANCHES_HELP)
    g.add_argument("--json", metavar="OUT", help="write what was measured or reused, and the times, to OUT")
    p.set_defaults(run=cmd_tune)


def _serve_parser(sub) -> None:
    """`batchspec serve`: the OpenAI-compatible server (server.py); methods that admit rows only;
    replicas on Ray Serve (replicas.py)."""
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API with continuous batching",
        description="Serve an OpenAI-compatible HTTP API with continuous batching: one process, N replicas "
        "behind Ray Serve (--replicas, --ray-address), or a target sharded over N processes (--tp). "
        "See docs/scale-out.md.",
    )
    _model_options(p)
    g = p.add_argument_group("decoding")
    served = [m.name for m in methods.METHODS.values() if m.serves]
    g.add_argument("--method", choices=served, default=served[0], help=f"a method the online engine runs ({served[0]})")
    g.add_argument("-k", type=k_value, default="auto", help=K_HELP)
    g.add_argument("--no-spec", action="store_true", help="plain decoding (k = 0) in the same engine")
    g.add_argument("--proposer", choices=list(PROPOSERS), help=PROPOSER_HELP)
    g.add_argument("--branches", type=branches_value, default=1, help=BRANCHES_HELP)
    g.add_argument("--batch-size", type=int, default=8, help="rows decoded together (default 8)")
    g.add_argument(
        "--kv-budget",
        type=int,
        dest="kv_budget_tokens",
        help="KV tokens all rows may reserve together; a request's prompt + max_tokens + k + 1 must fit "
        "(default: batch size x min(context, 2048))",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens prefilled per step while rows decode (default: from measured costs)",
    )
    g.add_argument(
        "--prefix-cache-tokens",
        type=int,
        metavar="N",
        help="KV entries of finished requests kept for later prompts that begin the same way (a chat's "
        "history, a shared system prompt), least recently used evicted (default: the KV budget)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole")
    g.add_argument("--batch-invariant", action="store_true", help=INVARIANT_HELP)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for a row before 429 (default 256); with --replicas: requests Ray Serve queues "
        "before 503",
    )
    g.add_argument(
        "--arrival-window-ms",
        type=float,
        default=50.0,
        help="when idle, how long a first request waits for others arriving right behind it (each within "
        "15 ms), so that requests sent together are prefilled together (default 50; 0: never wait)",
    )
    g.add_argument(
        "--max-itl-ms",
        type=float,
        default=DEFAULT_MAX_ITL_MS,
        help="the longest gap between a running request's steps that prefilling new prompts may cause: each "
        "iteration prefills only what fits beside its decode step, within this and --max-itl-steps "
        f"(default {DEFAULT_MAX_ITL_MS:g}; 0: no bound in ms; both bounds are off under --prefill-chunk)",
    )
    g.add_argument(
        "--max-itl-steps",
        type=float,
        default=DEFAULT_MAX_ITL_STEPS,
        help="that gap is also at most this many decode steps as measured, the step itself included "
        f"(default {DEFAULT_MAX_ITL_STEPS:g}; 0: no bound in steps)",
    )
    g.add_argument(
        "--spin",
        nargs="?",
        const="on",
        default="auto",
        choices=SPIN_MODES,
        help=f"whether the CPU's OpenMP workers spin between products: auto (default: while no other process "
        f"keeps {BUSY_CORES} of a core busy, and beside one while the batch holds at least {SPIN_ROWS} rows and "
        "nothing is being prefilled), on (bare --spin; faster on cores the server has to itself, much slower beside "
        "another busy process at small batches), off (they soon sleep: two OpenMP teams); docs/serving.md, "
        "Spinning while no one else computes. The output does not depend on it",
    )
    g.add_argument("--served-model-name", help="the model name clients use (default: the pair's name)")
    g.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish before they are cancelled (default 30)",
    )
    g = p.add_argument_group("access (docs/serving.md, Security)")
    g.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help=f"a key clients send as 'Authorization: Bearer KEY' (repeatable; also --api-key-file and "
        f"{access.ENV_KEY}); with a key set, every path but /health and /metrics (see --metrics-auth) needs one",
    )
    g.add_argument("--api-key-file", metavar="PATH", help="keys, one per line (blank lines and # comments skipped)")
    g.add_argument(
        "--require-api-key", action="store_true", help="refuse to start without a key (default: warn on a public host)"
    )
    g.add_argument("--metrics-auth", action="store_true", help="/metrics needs a key too (default: open)")
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=access.MAX_REQUEST_BYTES,
        metavar="N",
        help=f"largest request body; beyond it: 413 (default {access.MAX_REQUEST_BYTES})",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=access.BODY_TIMEOUT_S,
        metavar="S",
        help=f"seconds a client may take to send a request body; beyond it: 408 (default {access.BODY_TIMEOUT_S:g})",
    )
    g = p.add_argument_group("replicas (Ray Serve; pip install 'batchspec[ray]')")
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="N copies of the server behind Ray Serve's router, health checks and restarts (default 1: no Ray)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="an existing Ray cluster (e.g. auto, ray://head:10001); default: a local Ray instance",
    )
    g.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        metavar="X",
        help="CPUs Ray grants each replica, fractions allowed; torch uses max(1, floor(X)) threads (default 1)",
    )

    # exspec's pool and the invariant checker are offline options: the online engine has neither
    p.set_defaults(window_size=None, min_group=None, check_invariants=False)

    def run(args) -> int:
        config = serve_config(args)
        if (warning := access.check_binding(config.host, config.access.keys, False)) and tp.is_leader():
            print(warning, file=sys.stderr, flush=True)
        if config.uses_ray:
            from .serving.replicas import run_cli
        else:
            from .serving.server import run_cli
        return run_cli(config)

    p.set_defaults(run=run)


def serve_config(args) -> ServeConfig:
    """The checked `ServeConfig` of `batchspec serve`'s options, before any model loads (API keys
    are read from --api-key, --api-key-file and the environment)."""
    keys = access.read_keys(args.api_key, args.api_key_file, os.environ)
    access.check_binding(args.host, keys, args.require_api_key)
    policy = access.Policy(keys, args.metrics_auth, args.max_request_bytes, args.body_timeout)
    return ServeConfig(
        models=pair_spec(args),
        engine=engine_config(args, args.method, args.batch_size, progress=False),
        no_spec=args.no_spec,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        arrival_window_ms=args.arrival_window_ms,
        max_itl_ms=args.max_itl_ms,
        max_itl_steps=args.max_itl_steps,
        spin=args.spin,
        served_model_name=args.served_model_name,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_tokens=args.prefix_cache_tokens,
        graceful_timeout=args.graceful_timeout,
        access=policy,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        ray_address=args.ray_address,
    )


def _comparison(sub, name: str, help: str, methods: str, run) -> argparse.ArgumentParser:
    """A subcommand that runs several methods at several batch sizes on the same prompts."""
    p = sub.add_parser(name, help=help)
    _model_options(p)
    _prompt_options(p)
    _decode_options(p, one_method=False)
    p.add_argument("--methods", default=methods, help=f"comma-separated (default: {methods})")
    p.add_argument("--batch-sizes", default="1,4,8", help="comma-separated (default: 1,4,8)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)
    return p


def comparison_inputs(args):
    """Validated (params, methods, batch sizes, prompt texts, pair) for verify and bench; every
    option is checked before the (slow) model load."""
    params = sampling_params(args)
    names = parse_list(args.methods, str, "--methods")
    batch_sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
    ks, brs = k_values(args.k), branch_values(args.branches)
    for method in names:
        for batch in batch_sizes:
            for k in ks:
                for c in brs:
                    EngineConfig(method=method, batch_size=batch, **(engine_options(args) | {"k": k, "branches": c}))
    prompts = [p.text for p in load_prompts(args)]
    return params, names, batch_sizes, prompts, load_models(args)


def load_prompts(args) -> list[Prompt]:
    if args.prompts and args.prompt:
        raise BatchspecError("give prompts either on the command line or with --prompts, not both")
    if args.prompts:
        return read_prompts(args.prompts, args.limit, args.every)
    texts = args.prompt or DEFAULT_PROMPTS
    return [Prompt(t) for t in texts][: args.limit] if args.limit else [Prompt(t) for t in texts]


def sampling_params(args) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        logprobs=getattr(args, "logprobs", None),
        **constraint(args),
    )


def constraint(args) -> dict:
    """SamplingParams' constraint from --json-schema FILE, --regex or --grammar FILE (generate)."""
    given = [(flag, getattr(args, flag, None)) for flag in ("json_schema", "regex", "grammar")]
    given = [(flag, value) for flag, value in given if value is not None]
    if len(given) > 1:
        raise BatchspecError("give one of --json-schema, --regex and --grammar")
    if not given:
        return {}
    flag, value = given[0]
    if flag == "regex":
        return {"regex": value}
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise BatchspecError(f"--{flag.replace('_', '-')} {value}: {err.strerror}") from None
    return {flag: text}


def engine_options(args) -> dict:
    """The EngineConfig fields every method shares, from the command line (bench and verify pass
    them to every run)."""
    return dict(
        k=args.k,
        proposer=args.proposer,
        branches=args.branches,
        window_size=args.window_size,
        min_group=args.min_group,
        kv_budget_tokens=args.kv_budget_tokens,
        prefill_chunk=args.prefill_chunk,
        check_invariants=args.check_invariants,
        batch_invariant=invariant_modes(args)[0],
    )


def invariant_modes(args) -> list[bool]:
    """--batch-invariant as a list of modes: [True] or [False] (generate, serve), or what verify
    and bench were given ("on", "off", "off,on")."""
    value = args.batch_invariant
    if isinstance(value, bool):
        modes = [value]
    else:
        names = parse_list(value, str, "--batch-invariant")
        if any(n not in ("off", "on") for n in names):
            raise BatchspecError(f"--batch-invariant takes off, on or off,on, got {value!r}")
        modes = [n == "on" for n in names]
    if any(modes) and (getattr(args, "tp", 1) or 1) > 1:
        raise BatchspecError(invariant.NO_TP)
    return modes


def engine_config(args, method: str, batch_size: int, progress: bool) -> EngineConfig:
    return EngineConfig(method=method, batch_size=batch_size, progress=progress, **engine_options(args))


def pair_spec(args) -> PairSpec:
    """Where the pair comes from (the model options). A --target without --draft gets `auto`
    unless the proposer asked for needs no draft model."""
    draft = args.draft
    proposer = getattr(args, "proposer", None)
    if draft is None and args.target is not None and args.pair is None and proposer in (None, "draft", "ngram+draft"):
        draft = AUTO
    return PairSpec(
        args.pair,
        args.target,
        draft,
        args.dtype,
        args.device,
        args.tp,
        args.draft_dtype,
        args.draft_quant,
        args.draft_vocab,
        args.compile,
    )


def load_models(args):
    return pair_spec(args).load()


def cmd_generate(args) -> int:
    params = sampling_params(args)
    config = engine_config(args, args.method, args.batch_size, progress=not args.quiet)
    prompts = load_prompts(args)
    pair = load_models(args)
    dec = SpecDecoder(pair, config)
    outs = dec.generate([p.text for p in prompts], params, chat_template=not args.no_chat_template)
    for out in outs:
        mean = (
            "" if not out.logprobs else f", mean logprob {sum(e.logprob for e in out.logprobs) / len(out.logprobs):.3f}"
        )
        print(f"--- [{out.index}] {out.prompt[:70]!r} ({len(out.token_ids)} tokens, {out.finish_reason}{mean})")
        print(out.text)
    print(f"[{args.method}, batch {args.batch_size}, k {args.k}, {dec.proposer_name}] {dec.stats.line()}")
    if args.json:
        write_json(
            args.json,
            {
                "results": [o.to_json() | {"category": p.category} for o, p in zip(outs, prompts)],
                "stats": dec.stats.summary(),
                "config": {
                    "method": args.method,
                    "batch_size": args.batch_size,
                    "k": args.k,
                    "proposer": dec.proposer_name,
                    "sampling": params.__dict__,
                },
                "models": pair.describe(),
            },
        )
    return 0


def cmd_verify(args) -> int:
    if len(k_values(args.k)) > 1 or len(branch_values(args.branches)) > 1 or len(invariant_modes(args)) > 1:
        raise BatchspecError("verify takes one -k, --branches and --batch-invariant value (bench takes lists)")
    params, names, batch_sizes, prompts, pair = comparison_inputs(args)
    report = equivalence.verify(
        pair,
        prompts,
        names,
        batch_sizes,
        params,
        chat_template=not args.no_chat_template,
        progress=not args.quiet,
        on_run=(lambda partial: write_json(args.json, partial)) if args.json else None,
        **(engine_options(args) | {"k": k_values(args.k)[0], "branches": branch_values(args.branches)[0]}),
    )
    print(equivalence.table(report))
    for line in equivalence.divergence_lines(report):
        print(line)
    if args.json:
        write_json(args.json, report)
    return 0


def cmd_bench(args) -> int:
    if args.repeats < 1:
        raise BatchspecError(f"--repeats must be >= 1, got {args.repeats}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BatchspecError("--plot needs matplotlib: pip install 'batchspec[plot]'")
    params, names, batch_sizes, prompts, pair = comparison_inputs(args)
    options = engine_options(args) | {
        "k": k_values(args.k),
        "branches": branch_values(args.branches),
        "batch_invariant": invariant_modes(args),
    }
    report = bench.bench(
        pair, prompts, names, batch_sizes, params, repeats=args.repeats, progress=not args.quiet, **options
    )
    report["command"] = "batchspec " + " ".join(sys.argv[1:])
    print(bench.table(report))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        bench.plot(report, args.plot)
    return 0


def cmd_tune(args) -> int:
    batch_sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
    configs = [
        EngineConfig(batch_size=b, k=args.k, proposer=args.proposer, branches=args.branches, progress=False)
        for b in batch_sizes
    ]
    if diskcache.root() is None:
        raise BatchspecError("the cache is off (--no-tuning-cache or BATCHSPEC_CACHE=off): nothing to fill")
    if tunes_kernels(args):
        args.compile = TUNE  # the tuned packages where they fit in memory; later default starts load them
    pair = load_models(args)
    runs = []
    for config in configs:
        dec = SpecDecoder(pair, config)
        dec.prepare()
        runs.append({"batch_size": config.batch_size, "k": config.k, "proposer": dec.proposer_name} | dec.startup)
        print(f"batch {config.batch_size}, k {config.k}, {dec.proposer_name}{startup_text(dec.startup)}")
    print(f"cache: {diskcache.root()}")
    if args.json:
        write_json(args.json, {"cache": str(diskcache.root()), "runs": runs})
    return 0


def tunes_kernels(args) -> bool:
    """Whether `batchspec tune` asks for --max-autotune's packages (`compile="tune"`, which load_pair
    grants on a CPU, for a target compiled by default, within the memory budget): unless a flag or
    $BATCHSPEC_COMPILE chose a mode."""
    return args.compile is None and not compiled.env_setting()


def k_value(text: str) -> int | str:
    """-k: "auto" or an integer (range checks are EngineConfig's)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def k_values(text: str) -> list:
    """-k for comparisons: 'auto', '4' or '4,auto'."""
    return parse_list(str(text), k_value, "-k")


def branches_value(text: str) -> int | tuple[int, ...]:
    """--branches: "C" (C nodes at every depth) or "C1xC2x.." (per depth, the last repeated; range
    checks are EngineConfig's)."""
    try:
        widths = tuple(int(t) for t in str(text).strip().lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or per-depth widths like 4x2x1, got {text!r}") from None
    return widths[0] if len(widths) == 1 else widths


def branch_values(text: str) -> list:
    """--branches for comparisons: '1', '1,3' or '1,4x2x1'."""
    return parse_list(str(text), branches_value, "--branches")


def _draft_vocab(text: str) -> int | str:
    """--draft-vocab's value: "full" or an integer (load_pair checks its range)."""
    if text == "full":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or full, got {text!r}") from None


def parse_list(text: str, kind, flag: str) -> list:
    """'a,b,c' -> [kind(a), ...], with a clear error on a bad item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except argparse.ArgumentTypeError as err:
        raise BatchspecError(f"{flag}: {err}") from None
    except ValueError:
        raise BatchspecError(f"{flag}: expected a comma-separated list of {kind.__name__}, got {text!r}") from None
    if not values:
        raise BatchspecError(f"{flag}: empty list")
    return values


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def use_cache_options(args) -> None:
    """--tuning-cache / --no-tuning-cache, through the environment so that every process this one
    starts (tensor-parallel ranks, replicas) uses the same cache."""
    if args.tuning_cache and args.no_tuning_cache:
        raise BatchspecError("give --tuning-cache DIR or --no-tuning-cache, not both")
    if args.no_tuning_cache:
        os.environ[diskcache.ENV] = "off"
    elif args.tuning_cache:
        os.environ[diskcache.ENV] = os.path.abspath(args.tuning_cache)


def start_ranks(args, argv: list[str]) -> int | None:
    """--tp N: check the target can be split, then start N ranks (tp.py) and return their exit
    status; or, in a rank, join the group and return None. Rank 0 prints and writes files; the
    others run the same loop silently."""
    if args.command == "serve":
        serve_config(args)  # every check that needs no model, before the ranks start
    if hasattr(args, "batch_invariant"):
        invariant_modes(args)
    tp.check(target_config(args.pair, args.target), args.tp)
    status = tp.launch(args.tp, argv)
    if status is not None:
        return status
    args.device = tp.init(args.device)
    if not tp.is_leader():
        sys.stdout = open(os.devnull, "w")  # for the life of the process
        args.quiet, args.json = True, None
        if hasattr(args, "plot"):
            args.plot = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        use_cache_options(args)
        if args.tp != 1 and (status := start_ranks(args, argv)) is not None:
            return status
        if args.command == "generate":
            return cmd_generate(args)
        return args.run(args)
    except BatchspecError as err:
        print(f"batchspec: error: {err}", file=sys.stderr)
        return 2
    finally:
        tp.finish()


def run() -> None:
    """The console command: `main` in a process of its own."""
    # What the imports built lives until the process ends: kept out of every collection, the run's
    # and the one at exit (about 1 s with torch, its compiler and transformers loaded).
    gc.freeze()
    sys.exit(main())


if __name__ == "__main__":
    run()
