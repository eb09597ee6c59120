"""`batchspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the online engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE when "stream"), GET /v1/models,
GET /health (503 when the engine loop is dead or stalled), GET /metrics (Prometheus text). Behind a
router of replicas (replicas.py) every response names its replica in an `x-batchspec-replica`
header.

Before the app, `access.Guard` checks the API key and bounds the body (bytes, time, type). Then a
request is validated and encoded here (errors are 400s in OpenAI's shape, naming the field and
the numbers), then queued in the engine (429 at once when the queue is full); its chunks come back
through an asyncio queue. A streaming client that
disconnects, or a non-streaming one that goes away (or whose handler is cancelled), has its row
cancelled (freed before the next step). SIGTERM: uvicorn stops accepting, lets running requests
finish (up to --graceful-timeout), then the engine cancels what is left and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..core.config import SamplingParams
from ..core.detok import TokenBytes
from ..core.errors import BatchspecError
from ..core.sequence import Sequence
from ..core.stats import startup_text
from ..distributed import tp
from ..engine.lockstep import LockstepEngine
from ..engine.online import Chunk, OnlineEngine, QueueFull, ShuttingDown
from ..engine.online import Request as EngineRequest
from ..engine.step import Context
from ..engine.threads import SPIN_ROWS, EngineThread
from ..models import invariant
from ..policy import drafter
from ..policy.speculation import prepare
from ..proposers.make import make_proposer
from . import access
from . import openai_api as api
from . import tools as tools_api
from .config import ServeConfig
from .metrics import EngineCollector

#: KV tokens per row of the batch when --kv-budget is not given (or the model's context, if smaller).
#: /health fails when the engine loop has not begun an iteration for this long (a step, or one
#: chunk of prefill, taking longer counts as a stall).
STALL_S = 120.0


def _template_errors() -> tuple[type[Exception], ...]:
    """What a chat template raises for messages it refuses (jinja2 comes with chat templates)."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return ()
    return (TemplateError,)


TEMPLATE_ERRORS = _template_errors()


class Service:
    """What the HTTP layer needs: the engine, the pair (tokenizer, context) and limits."""

    def __init__(self, engine: OnlineEngine, pair, model_name: str, tokenizer_lock: threading.Lock):
        self.engine, self.pair, self.model_name, self.lock = engine, pair, model_name, tokenizer_lock
        self.k, self.budget, self.context = engine.ctx.slots, engine.budget, pair.context_len
        self.rejected: dict[str, int] = {}  # outcome -> requests refused before the engine
        self.policy = access.Policy()  # keys and body bounds (build_service sets the options')
        self.startup: dict = {}  # load and tuning seconds (SpecDecoder.startup)
        self.token_bytes = TokenBytes(pair.tokenizer)  # for logprobs (memoised; under `lock`)

    def logprobs(self, job: api.Job, entries: list | None, offset: int = 0) -> dict | None:
        """The OpenAI `logprobs` body of entries (None when the job did not ask)."""
        if not job.logprobs or entries is None:
            return None
        with self.lock:
            return api.logprobs_body(job.chat, entries, self.token_bytes, offset)

    def refused(self, outcome: str) -> None:
        self.rejected[outcome] = self.rejected.get(outcome, 0) + 1

    def encode(self, job: api.Job, prompt) -> list[int]:
        """One of the job's prompts as token ids; a prompt the tokenizer or the chat template
        refuses is a 400."""
        with self.lock:
            try:
                if job.chat:
                    return chat_ids(self.pair.tokenizer, prompt, job.tools)
                return self.pair.encode(prompt, chat_template=False)
            except (BatchspecError, *TEMPLATE_ERRORS) as err:
                raise api.BadRequest(str(err), "messages" if job.chat else "prompt") from None

    def sequence(self, job: api.Job, ids: list[int], index: int = 0) -> Sequence:
        """Check the prompt against the context and the KV budget; the Sequence of the request's
        choice `index` (its prompt's sample index % n: a given seed s becomes s + index % n)."""
        room = self.budget - self.k - 1  # the whole budget, less the draft slots of a last step
        n = len(ids)
        if n >= self.context:
            raise api.BadRequest(
                f"the prompt has {n} tokens, but the model's context is {self.context} tokens",
                "messages" if job.chat else "prompt",
                code="context_length_exceeded",
            )
        default = min(room, self.context) - n if job.chat else 16
        max_tokens = job.max_tokens if job.max_tokens is not None else default
        if max_tokens < 1 or n + max_tokens > room:
            raise api.BadRequest(
                f"the prompt ({n} tokens) + max_tokens ({max_tokens}) + {self.k + 1} draft slots = "
                f"{n + max_tokens + self.k + 1} exceeds the KV budget of {self.budget} tokens",
                "max_tokens",
                code="context_length_exceeded",
            )
        seed = job.params.seed + index % job.n if job.params.seed is not None else None
        params = SamplingParams(**{**job.params.__dict__, "max_new_tokens": max_tokens, "seed": seed})
        return Sequence.request(index, ids, params, self.context, self.pair.eos_ids, self.matcher(job, params))

    def matcher(self, job: api.Job, params: SamplingParams):
        """The request's grammar state (None when free); a grammar the engine cannot compile is a
        400 (under --tp each follower compiles its own: lockstep.NewRequest)."""
        if params.constraint is None:
            return None
        where = job.constraint_field
        try:
            return self.pair.matcher(params)
        except BatchspecError as err:
            raise api.BadRequest(str(err), where) from None


def chat_ids(tokenizer, messages: list[dict], tools: tools_api.Tools | None = None) -> list[int]:
    """Messages (and the tools offered) through the tokenizer's chat template; without one,
    'role: content' lines (tools.render writes tools into the messages where the template
    takes none)."""
    messages, specs = tools_api.render(messages, tools, tools_api.supports_tools(tokenizer))
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tools=specs, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


class ReplicaHeader:
    """ASGI middleware: an `x-batchspec-replica: <name>` header on every HTTP response (streams
    included: it is added to the response start)."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (b"x-batchspec-replica", name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def create_app(service: Service, replica: str | None = None) -> FastAPI:
    """The HTTP app over a service; `replica` names it in a header on every response."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(service))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        yield
        await asyncio.to_thread(service.engine.shutdown)

    app = FastAPI(title="batchspec", lifespan=lifespan)
    app.add_middleware(access.Guard, policy=service.policy, count=service.refused)
    if replica is not None:  # added last: outermost, so refusals are named too
        app.add_middleware(ReplicaHeader, name=replica)

    @app.exception_handler(Exception)
    async def internal(request, err):  # a fault in one request fails that request only
        return JSONResponse(api.error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), 500)

    @app.get("/health")
    async def health():
        fault = service.engine.fault(STALL_S)
        body = {"status": "ok" if fault is None else "unhealthy", "pid": os.getpid()}
        if replica is not None:
            body["replica"] = replica
        return body if fault is None else JSONResponse({**body, "error": fault}, 503)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "batchspec",
            "max_model_len": service.context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(service, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(service, request, chat=True)

    return app


def _refuse(service: Service, err: api.BadRequest) -> JSONResponse:
    kind = "rate_limit_error" if err.status == 429 else "invalid_request_error"
    service.refused({429: "queue_full", 503: "shutting_down"}.get(err.status, "invalid"))
    return JSONResponse(api.error_body(err.message, kind, err.param, err.code), err.status)


async def serve(service: Service, request: Request, chat: bool):
    """Validate, queue, and answer one request (a JSON body, or an SSE stream). The body is
    already bounded (access.Guard)."""
    try:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, too many digits, too deep
            raise api.BadRequest(f"the request body is not valid JSON: {_short(err)}") from None
        job = api.parse_job(body, chat)
        if job.model is not None and job.model != service.model_name:
            raise api.BadRequest(
                f"the model '{job.model}' does not exist; this server serves '{service.model_name}'",
                "model",
                404,
                "model_not_found",
            )
        encoded = [service.encode(job, p) for p in job.prompts]
        choices = [(ids, i * job.n + j) for i, ids in enumerate(encoded) for j in range(job.n)]
        if job.params.constraint is None:
            seqs = [service.sequence(job, ids, index) for ids, index in choices]
        else:  # a grammar compiles in a worker thread, not on the event loop
            seqs = await asyncio.to_thread(lambda: [service.sequence(job, ids, index) for ids, index in choices])
        chunks: asyncio.Queue[tuple[int, Chunk]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        handles = [EngineRequest(seq, _emitter(loop, chunks, i)) for i, seq in enumerate(seqs)]
        _submit(service, handles)
    except api.BadRequest as err:
        return _refuse(service, err)
    rid = api.new_id(chat)
    if job.stream:
        return StreamingResponse(_stream(service, job, handles, chunks, rid), media_type="text/event-stream")
    return await _complete(service, job, handles, chunks, rid, request)


def _submit(service: Service, handles: list[EngineRequest]) -> None:
    """Queue every choice's row, or none: a full queue or a shutdown cancels those queued."""
    for n, handle in enumerate(handles):
        try:
            service.engine.submit(handle)
        except (QueueFull, ShuttingDown) as err:
            for queued in handles[:n]:
                service.engine.cancel(queued)
            if isinstance(err, QueueFull):
                raise api.BadRequest(str(err), None, 429, "queue_full") from None
            raise api.BadRequest(str(err), None, 503, "shutting_down") from None


def _short(err: Exception) -> str:
    text = f"{err}" if not isinstance(err, RecursionError) else "it is nested too deeply"
    return text if len(text) <= 200 else text[:200] + "..."


def _emitter(loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue, index: int):
    """A thread-safe, non-blocking sink for the engine thread: (choice index, chunk)."""

    def emit(chunk: Chunk) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            loop.call_soon_threadsafe(chunks.put_nowait, (index, chunk))

    return emit


def _failure(chunk: Chunk) -> tuple[str, int] | None:
    """(message, status) when a row ended in an error or was aborted by a shutdown."""
    if chunk.finish_reason not in ("error", "abort"):
        return None
    message = chunk.error or "the request was cancelled (the server is shutting down)"
    return message, 500 if chunk.finish_reason == "error" else 503


def _cancel_unfinished(service: Service, handles: list[EngineRequest]) -> None:
    for handle in handles:
        if not handle.seq.finished:  # the client went away (or the request failed): free the row
            service.engine.cancel(handle)


def _extension(seq: Sequence, token_ids: list[int]) -> dict:
    steps = seq.accepted_per_step
    return {
        "token_ids": token_ids,
        "steps": len(steps),
        "accepted_drafts": sum(steps),
        "proposed_drafts": seq.proposed_drafts,
    }


async def _complete(service: Service, job, handles, chunks: asyncio.Queue, rid: str, request: Request):
    """Collect every choice's whole output; cancel the rows if the client goes away (or this
    handler is cancelled, as a router does when its client goes) meanwhile."""
    texts, tokens, logprobs = [[] for _ in handles], [[] for _ in handles], [[] for _ in handles]
    finish: list[str | None] = [None] * len(handles)
    try:
        while None in finish:
            try:
                index, chunk = await asyncio.wait_for(chunks.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if (failed := _failure(chunk)) is not None:
                return JSONResponse(api.error_body(failed[0], "server_error"), failed[1])
            texts[index].append(chunk.text)
            tokens[index] += chunk.token_ids
            logprobs[index] += chunk.logprobs or []
            finish[index] = chunk.finish_reason
    finally:
        _cancel_unfinished(service, handles)
    outputs = [
        ("".join(t), f, _extension(h.seq, ids), service.logprobs(job, lp))
        for t, f, h, ids, lp in zip(texts, finish, handles, tokens, logprobs)
    ]
    use = api.usage(sum(h.seq.prompt_len for h in handles), sum(map(len, tokens)))
    return api.response(job, rid, service.model_name, outputs, use)


async def _stream(service: Service, job, handles, chunks: asyncio.Queue, rid: str):
    """SSE: chunks with text as the rows make them (choices interleaved, each chunk naming its
    `index`), a final one per choice with its finish_reason, then the usage, then [DONE]."""
    name, counts, left = service.model_name, [0] * len(handles), len(handles)
    offsets = [0] * len(handles)  # characters of each choice's tokens so far (completions' text_offset)
    calls = [tools_api.Stream(job.tools) for _ in handles] if job.tools is not None and job.tools.calls else None
    try:
        for index in range(len(handles)) if job.chat else ():  # each choice's first delta names the role
            yield _sse(api.chunk(job, rid, name, "", None, role=True, index=index))
        while left:
            index, chunk = await chunks.get()
            counts[index] += len(chunk.token_ids)
            if (failed := _failure(chunk)) is not None:
                yield _sse(api.error_body(failed[0], "server_error"))
                break
            if chunk.text or chunk.token_ids:
                extension = {"token_ids": chunk.token_ids}
                logprobs = service.logprobs(job, chunk.logprobs, offsets[index])
                if logprobs is not None and not job.chat:
                    offsets[index] += sum(map(len, logprobs["tokens"]))
                text = chunk.text if calls is None else calls[index].feed(chunk.text) or None
                yield _sse(api.chunk(job, rid, name, text, None, extension, index=index, logprobs=logprobs))
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
                if calls is not None:  # what was held back: content, and the calls whole
                    content, made = calls[index].finish()
                    if content is not None or made:
                        yield _sse(api.chunk(job, rid, name, content, None, index=index, calls=made))
                    finish = "tool_calls" if made and finish == "stop" else finish
                yield _sse(api.chunk(job, rid, name, None if job.chat else "", finish, index=index))
                left -= 1
        if not left and job.include_usage:
            use = api.usage(sum(h.seq.prompt_len for h in handles), sum(counts))
            yield _sse(api.usage_chunk(job, rid, name, use, _extension(handles[0].seq, [])))
        yield "data: [DONE]\n\n"
    finally:
        _cancel_unfinished(service, handles)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def run_cli(config: ServeConfig) -> int:
    """Load the pair, build the engine, serve until SIGTERM/SIGINT; exit status 0."""
    import uvicorn

    service = build_service(config)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the handler
    # that was there before it: make that a no-op, so a graceful stop exits with status 0. (A
    # tensor-parallel follower ignores them too: it stops when rank 0 does.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if not tp.is_leader():
        _on_loading_thread(config, service.engine.worker, service.engine.follow)
        return 0
    app = create_app(service)
    print(
        f"batchspec: serving {service.model_name!r} on http://{config.host}:{config.port} "
        f"(k={config.k}, {service.engine.capacity} rows, KV budget {service.budget} tokens)"
        + startup_text(service.startup),
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    uvicorn.run(  # h11 (not httptools, if installed): its 16 KiB bound on request headers
        app,
        host=config.host,
        port=config.port,
        http="h11",
        log_level="warning",
        timeout_graceful_shutdown=config.graceful_timeout,
    )
    print(f"batchspec: stopped after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return 0


def build_service(config: ServeConfig) -> Service:
    """The pair, the proposer and the online engine of a `ServeConfig`: made on this thread, or
    under `--spin on|auto` on the thread that will run the engine loop (every torch call on one
    thread: one OpenMP team; engine/threads.py)."""
    worker = EngineThread()
    return _on_loading_thread(config, worker, _build_service, config, worker)


def _on_loading_thread(config: ServeConfig, worker: EngineThread, fn, *args):
    """fn(*args) on the thread that loads the models: the engine's `worker` under `--spin on|auto`,
    else this one."""
    return worker.call(fn, *args) if config.spin != "off" else fn(*args)


def _build_service(config: ServeConfig, worker: EngineThread) -> Service:
    pair = config.models.load()
    invariant.apply(pair.target, config.engine.batch_invariant)
    choice = None if config.no_spec else drafter.choose(pair, config.engine)
    runs_on = drafter.pair_to_run(choice, pair)
    proposer, _ = (None, None) if config.no_spec else make_proposer(runs_on, config.engine, choice and choice.proposer)
    speculation, report = prepare(config.engine, pair.target, proposer)  # from the cache where it has them
    ctx = Context.of(pair, proposer, config.k, speculation)
    budget = config.kv_budget(pair.context_len)
    lock = threading.Lock()

    def decode(ids: list[int]) -> str:
        with lock:
            return pair.decode(ids)

    engine_class = LockstepEngine if tp.active() else OnlineEngine  # every rank runs the loop; rank 0 leads
    prefix_tokens = (config.prefix_cache_tokens or budget) if config.prefix_cache else None
    chunk = config.engine.prefill_chunk
    engine = engine_class(
        ctx,
        config.engine.batch_size,
        budget,
        decode,
        config.max_queue,
        chunk,
        prefix_tokens,
        config.arrival_window_ms / 1000,
        worker,
        SPIN_ROWS if config.spin == "auto" else None,
        config.max_itl_ms / 1000 or None,
        config.max_itl_steps or None,
    )
    if tp.active():
        engine.matcher_of = pair.matcher
    service = Service(engine, pair, config.served_model_name or pair.name, lock)
    service.policy = config.access
    service.startup = pair.startup | report | ({"drafter": choice.why} if choice else {})
    return service
