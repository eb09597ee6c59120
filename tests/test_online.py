"""The pure and in-process parts of serving: per-row sampling in one batch (mixed greedy and
seeded rows, every method), stop strings, incremental detokenisation, the engine loop's
cancellation, and per-request fault isolation in the online engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import random_prompts, reference_tokens

from batchspec import SamplingParams, SpecDecoder
from batchspec.core.detok import Detokenizer, TextOutput, find_stop
from batchspec.core.sampling import RowParams, probabilities
from batchspec.engine.loop import Loop
from batchspec.engine.online import Chunk, OnlineEngine, Request
from batchspec.engine.step import Context
from batchspec.layouts.ragged import RaggedBatch

MIXED = [
    SamplingParams(max_new_tokens=20),
    SamplingParams(temperature=0.7, seed=1, max_new_tokens=25),
    SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_new_tokens=12),
    SamplingParams(max_new_tokens=30),
    SamplingParams(temperature=1.0, top_k=5, seed=3, max_new_tokens=20),
    SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=4, max_new_tokens=18),
]


def test_per_row_probabilities_equal_each_row_alone():
    logits = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(0))
    params = [MIXED[i] for i in (0, 2, 4, 5)]
    together = probabilities(logits, RowParams.of(params))
    for b, p in enumerate(params):
        assert torch.equal(together[b], probabilities(logits[b : b + 1], RowParams.of([p]))[0])
        if not p.greedy:
            assert torch.equal(together[b], probabilities(logits[b], p))
    assert torch.equal(together[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 50).float())


@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec", "ar"])
def test_mixed_rows_greedy_equal_reference_and_seeded_equal_alone(tiny64, method):
    prompts = random_prompts(70, len(MIXED), 2, 30)
    together = SpecDecoder(tiny64, method=method, batch_size=4, k=3).generate(prompts, MIXED)
    for i, (prompt, p) in enumerate(zip(prompts, MIXED)):
        if p.greedy:
            assert together[i].token_ids == reference_tokens(tiny64, [prompt], p.max_new_tokens)[0], f"row {i}"
        else:
            alone_method = "reference" if method == "ar" else "spec1"  # k = 0 draws 1 uniform per token
            alone = SpecDecoder(tiny64, method=alone_method, k=3).generate([prompt], p)[0]
            assert together[i].token_ids == alone.token_ids, f"row {i}"


def _byte_decode(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_detokenizer_releases_whole_characters():
    text = "añ€😀 ok 中文"
    ids = list(text.encode())
    detok, deltas = Detokenizer(_byte_decode), []
    for t in ids:
        deltas.append(detok.add(t))
        assert "\ufffd" not in deltas[-1]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    half = Detokenizer(_byte_decode)
    assert half.add(0xE2) == "" and half.flush() == "\ufffd"  # a cut character decodes as decode() does


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_stop_string_cut_exactly_inside_a_multi_token_step(chunks):
    ids = list("héllo wörld, STOP here".encode())
    out, streamed, fed = TextOutput(_byte_decode, ("STOP", "xyz")), [], 0
    while fed < len(ids) and not out.stopped:
        out.feed(ids[fed : fed + chunks])
        fed += chunks
        streamed.append(out.take())
    streamed.append(out.take(final=True))
    assert out.stopped and out.text == "héllo wörld, " and "".join(streamed) == out.text
    assert out.num_tokens == len("héllo wörld, STOP".encode())  # up to the token completing "STOP"
    assert find_stop("abcab", ("ca", "bc")) == 1  # the stop string that ends first


def test_generate_with_stop_strings(tiny64):
    prompt = random_prompts(71, 1, 5, 20)[0]
    full = SpecDecoder(tiny64, method="ragged", k=3).generate([prompt], SamplingParams(max_new_tokens=30))[0]
    stop = full.text[5:7]
    if not stop.strip("\ufffd") or stop in full.text[:5]:
        pytest.skip("no usable stop string in this output")
    for method in ("ragged", "eqspec", "reference"):
        out = SpecDecoder(tiny64, method=method, k=3).generate(
            [prompt], SamplingParams(max_new_tokens=30, stop=[stop])
        )[0]
        assert (out.text, out.finish_reason) == (full.text[:5], "stop"), method
        assert out.token_ids == full.token_ids[: len(out.token_ids)]


def _context(pair, k=3):
    dec = SpecDecoder(pair, method="ragged", k=k)
    return Context(target=pair.target, proposer=dec.proposer, k=k, pad_id=pair.pad_id, device=pair.device)


def _seq(pair, prompt, params):
    dec = SpecDecoder(pair, method="ragged")
    return dec.make_sequences([prompt], params)[0]


def test_loop_retires_a_cancelled_row_before_the_next_step(tiny64):
    ctx = _context(tiny64)
    loop = Loop(ctx, RaggedBatch(ctx.models(), 2, 256, ctx.k, ctx.pad_id, ctx.device))
    seqs = [_seq(tiny64, p, SamplingParams(max_new_tokens=60)) for p in random_prompts(72, 3, 3, 10)]
    for s in seqs:
        loop.add(s)
    loop.iterate()
    assert len(loop.batch) == 2 and len(loop.waiting) == 1
    seqs[0].cancelled = True
    done = loop.iterate()
    assert seqs[0] in done and seqs[0].finish_reason == "abort" and seqs[0] not in loop.batch.seqs
    assert seqs[2] in loop.batch.seqs  # its row went to the waiting request in the same iteration
    loop.run()
    assert all(s.finished for s in seqs)
    assert seqs[1].generated == reference_tokens(tiny64, [seqs[1].prompt_ids], 60)[0]


def test_a_failing_request_fails_alone(tiny64):
    ctx = _context(tiny64)
    engine = OnlineEngine(ctx, 4, 128, _byte_decode).start()
    results: dict[int, list[Chunk]] = {0: [], 1: []}
    done = threading.Event()

    def sink(i):
        def emit(chunk: Chunk):
            if i == 0 and chunk.token_ids:
                raise RuntimeError("output processing failed")
            results[i].append(chunk)
            if i == 1 and chunk.finish_reason:
                done.set()

        return emit

    prompts = random_prompts(73, 2, 3, 10)
    try:
        for i in (0, 1):
            engine.submit(Request(_seq(tiny64, prompts[i], SamplingParams(max_new_tokens=20)), sink(i)))
        assert done.wait(30)
        time.sleep(0.2)
        assert results[0][-1].finish_reason == "error" and "output processing failed" in results[0][-1].error
        tokens = [t for c in results[1] for t in c.token_ids]
        assert tokens == reference_tokens(tiny64, [prompts[1]], 20)[0]
        assert engine.counters.outcomes == {"error": 1, "length": 1}
    finally:
        engine.shutdown()
    assert not engine.thread.is_alive()


def _sinks(n: int):
    """Per request i < n: the chunks it got, an event set by its last one, and `sink(i)`, its emit."""
    results = {i: [] for i in range(n)}
    finished = {i: threading.Event() for i in range(n)}

    def sink(i):
        def emit(chunk: Chunk):
            results[i].append(chunk)
            if chunk.finish_reason:
                finished[i].set()

        return emit

    return results, finished, sink


def test_a_failed_step_fails_its_rows_and_the_rebuilt_batch_serves_on(tiny64, monkeypatch):
    """A fault injected into the third decode step: the two running rows end with "error", the
    request still waiting keeps its place, the batch is rebuilt with empty caches, and what runs
    after it (the waiting request, and one submitted later) equals the reference."""
    from batchspec.engine import loop as loop_module

    calls = {"n": 0}
    real_step = loop_module.decode_step

    def flaky(ctx, batch, rider=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step(ctx, batch, rider)

    monkeypatch.setattr(loop_module, "decode_step", flaky)
    ctx = _context(tiny64)
    engine = OnlineEngine(ctx, 2, 256, _byte_decode)  # started once the first three are queued
    prompts = random_prompts(74, 4, 3, 12)
    results, finished, sink = _sinks(4)
    try:
        for i in range(3):
            engine.submit(Request(_seq(tiny64, prompts[i], SamplingParams(max_new_tokens=30)), sink(i)))
        engine.start()
        assert all(finished[i].wait(60) for i in range(3))
        assert [results[i][-1].finish_reason for i in range(3)] == ["error", "error", "length"]
        assert "injected fault" in results[0][-1].error
        tokens = lambda i: [t for c in results[i] for t in c.token_ids]  # noqa: E731
        assert tokens(2) == reference_tokens(tiny64, [prompts[2]], 30)[0]
        engine.submit(Request(_seq(tiny64, prompts[3], SamplingParams(max_new_tokens=30)), sink(3)))
        assert finished[3].wait(60)
        assert tokens(3) == reference_tokens(tiny64, [prompts[3]], 30)[0]
        time.sleep(0.2)
        assert engine.counters.outcomes == {"error": 2, "length": 2}
        assert engine.counters.running == 0 and engine.counters.kv_slots_used == 0 and engine.queued == 0
    finally:
        engine.shutdown()
    assert not engine.thread.is_alive()


@pytest.mark.parametrize("window", [0.0, 2.0])
def test_requests_arriving_together_are_taken_together(tiny64, monkeypatch, window):
    """An idle engine takes, with its first request, those arriving right behind it (each within
    the gap) for up to the arrival window; with no window, the first alone. The gap is widened to
    0.5 s here so that the arrivals, 50 ms apart, fall inside it on a loaded machine too."""
    from batchspec.engine import online

    monkeypatch.setattr(online, "ARRIVAL_GAP_S", 0.5)
    engine = OnlineEngine(_context(tiny64), 8, 256, _byte_decode, arrival_window=window)
    prompts = random_prompts(75, 4, 3, 10)
    requests = [Request(_seq(tiny64, p, SamplingParams(max_new_tokens=4)), lambda chunk: None) for p in prompts]

    def arrive():
        for request in requests[1:]:
            time.sleep(0.05)
            engine.inbox.put(request)

    engine.inbox.put(requests[0])
    sender = threading.Thread(target=arrive)
    sender.start()
    taken = engine._drain(block=True)
    sender.join()
    assert taken == (requests if window else requests[:1])
    start = time.monotonic()
    assert engine._drain(block=True) == ([] if window else requests[1:])
    assert time.monotonic() - start < 5  # an empty inbox: back after the 50 ms poll


def test_a_long_prefill_is_progress_not_a_stall(tiny64):
    """Every prefill forward refreshes the heartbeat health checks read: an idle engine prefilling
    many long prompts in one iteration is not reported stalled (and restarted) meanwhile."""
    engine = OnlineEngine(_context(tiny64), 4, 256, _byte_decode)
    engine.beat = time.monotonic() - 1000
    engine.loop.admission.add(_seq(tiny64, random_prompts(76, 1, 5, 9)[0], SamplingParams(max_new_tokens=2)))
    engine.loop.admission.admit(engine.loop.batch)
    assert time.monotonic() - engine.beat < 60


def test_freed_heap_pages_go_back_once_the_loop_idles(tiny64, monkeypatch):
    """heap.trim runs once the loop has idled IDLE_TRIM_S after work (not again while it stays
    idle), and every TRIM_EVERY_S whatever the load; glibc's trim is found on this machine."""
    import platform

    from batchspec.core import heap
    from batchspec.engine import online

    assert heap.trim() or platform.libc_ver()[0] != "glibc"
    calls = []
    monkeypatch.setattr(online.heap, "trim", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr(online, "IDLE_TRIM_S", 0.3)
    monkeypatch.setattr(online, "TRIM_EVERY_S", 1000.0)
    engine = OnlineEngine(_context(tiny64), 2, 256, _byte_decode).start()
    done = threading.Event()
    try:
        time.sleep(0.6)
        assert calls == []  # nothing served yet: nothing to give back
        seq = _seq(tiny64, random_prompts(76, 1, 3, 10)[0], SamplingParams(max_new_tokens=8))
        engine.submit(Request(seq, lambda chunk: chunk.finish_reason and done.set()))
        assert done.wait(30)
        finished = time.monotonic()
        deadline = finished + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)
        assert len(calls) == 1 and calls[0] - finished >= 0.25
        monkeypatch.setattr(online, "TRIM_EVERY_S", 0.2)
        time.sleep(0.6)
        assert len(calls) >= 2
    finally:
        engine.shutdown()


def test_the_engine_thread_runs_calls_in_order_and_hands_back_errors():
    from batchspec.engine.threads import EngineThread

    worker, seen = EngineThread(), []
    assert worker.call(lambda: seen.append(threading.get_ident()) or 7) == 7
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    later = worker.submit(lambda: seen.append(threading.get_ident()))
    worker.close()
    later.result(5)
    worker.thread.join(5)
    assert not worker.thread.is_alive()
    assert seen == [worker.thread.ident] * 2 and threading.get_ident() not in seen


def _eventually(condition, timeout: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (polled; for the watchdog's own moves)."""
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def _tasks() -> int:
    """This process's threads, a moment after a change (a released team's workers take it to exit)."""
    import os

    time.sleep(0.05)
    return len(os.listdir("/proc/self/task"))


def test_spin_auto_beside_a_busy_process_holds_a_second_openmp_team_while_products_are_small():
    """threads.Spin while another process is busy: a ballast thread (and, with more than one torch
    thread, the OpenMP worker of its team) exists while the batch has fewer rows than the
    threshold or the iteration prefills, and is gone otherwise; the watchdog leaves a spin for
    large products alone."""
    from batchspec.engine.threads import Spin

    torch.ones(1 << 18).add_(1)  # this thread's own team exists before counting
    alone = _tasks() + 1  # and the watchdog thread
    extra = 1 + (torch.get_num_threads() > 1)  # the ballast thread and its team's worker
    spin = Spin(rows=12, load=lambda: 1.0, check_s=0.02)
    try:
        assert not spin.spinning and _tasks() == alone + extra  # nothing measured yet: throttled
        spin.follow(11)
        assert not spin.spinning and spin.switches == 0
        spin.follow(12)
        assert _eventually(lambda: spin.measured)  # the watchdog has measured a busy machine
        assert spin.shared and spin.spinning and _tasks() == alone and spin.switches == 1
        spin.follow(16)
        assert spin.spinning and spin.switches == 1
        spin.follow(16, prefill=True)  # a prefill forward collapses beside a busy process
        assert not spin.spinning and _tasks() == alone + extra and spin.switches == 2
        spin.follow(3)
        assert not spin.spinning and spin.switches == 2
    finally:
        spin.close()
    assert _tasks() == alone - 1


def test_spin_auto_on_a_machine_of_its_own_spins_until_another_process_is_busy():
    """threads.Spin while no other process is busy: spinning at any batch size, prefill or not.
    Once one is, the watchdog throttles the workers mid-iteration (no `follow` needed), and lets
    them spin again after QUIET_S of quiet, mid-iteration too."""
    from batchspec.engine import threads

    load = {"cores": 0.0}
    spin = threads.Spin(rows=12, load=lambda: load["cores"], check_s=0.02)
    try:
        assert _eventually(lambda: spin.measured)
        for rows, prefill in [(0, False), (1, False), (3, True), (16, True)]:
            spin.follow(rows, prefill)
            assert spin.spinning
        assert spin.switches == 1
        load["cores"] = threads.BUSY_CORES
        assert _eventually(lambda: not spin.spinning) and spin.switches == 2
        load["cores"] = 0.0
        time.sleep(0.1)
        spin.follow(3)
        assert not spin.spinning  # quiet for less than QUIET_S
        assert _eventually(lambda: spin.spinning) and spin.switches == 3  # the watchdog lets it go by itself
        spin.follow(3)
        assert spin.spinning and spin.switches == 3
    finally:
        spin.close()


def test_the_other_processes_load_counts_a_busy_child():
    """threads.OtherLoad: a child process spinning for a second shows as at least half a core."""
    import subprocess
    import sys

    from batchspec.engine import threads

    load = threads.OtherLoad()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"]
    )
    time.sleep(1.0)
    busy = load()
    child.wait()
    assert busy >= 0.5


@pytest.mark.parametrize("others", [0.0, 1.0])
def test_spin_auto_in_the_engine_follows_the_iterations_products(tiny64, monkeypatch, others):
    """Under --spin auto with a small batch: beside a busy process every prefill forward and
    every decode step runs throttled; on a machine of its own, spinning. The output equals the
    reference either way."""
    import functools

    from batchspec.engine import loop as loop_module
    from batchspec.engine import online, threads

    monkeypatch.setattr(online, "Spin", functools.partial(threads.Spin, load=lambda: others, check_s=0.02))
    engine = OnlineEngine(_context(tiny64), 4, 256, _byte_decode, spin_rows=12)
    prefills, steps = [], []  # whether the workers spun: at each prefill forward, at each decode step
    engine.loop.admission.progress = lambda: (prefills.append(engine.spin.spinning), engine._beat())
    real_step = loop_module.decode_step

    def step(ctx, batch, rider=None):
        steps.append(engine.spin.spinning)
        return real_step(ctx, batch, rider)

    monkeypatch.setattr(loop_module, "decode_step", step)
    prompts = random_prompts(77, 3, 3, 12)
    results, finished, sink = _sinks(3)
    engine.start()
    time.sleep(0.3)  # the load is measured
    try:
        for i in range(3):
            engine.submit(Request(_seq(tiny64, prompts[i], SamplingParams(max_new_tokens=24)), sink(i)))
            time.sleep(0.3)  # three arrivals, three admissions
        assert all(finished[i].wait(60) for i in range(3))
    finally:
        engine.shutdown()
    assert len(prefills) >= 3 and len(steps) >= 8
    assert set(prefills) == set(steps) == {others == 0.0}
    for i in range(3):
        tokens = [t for c in results[i] for t in c.token_ids]
        assert tokens == reference_tokens(tiny64, [prompts[i]], 24)[0]
