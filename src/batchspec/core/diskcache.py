"""What batchspec keeps on disk between runs, so that a start does not redo the last one's work:
measurements of the machine (`tuning`: the linear layers' formulations, the step-cost probes),
GGUF files converted once to a safetensors directory (`models`), and compiled graphs (`graphs`,
models/precompiled.py; `packages`, `--max-autotune`'s, models/packaged.py; `vector-isas`: the
verdict of inductor's check of the CPU's vector ISAs).

Where: `$BATCHSPEC_CACHE` (the CLI's `--tuning-cache DIR` sets it, for the processes it starts
too), else `$XDG_CACHE_HOME/batchspec`, else `~/.cache/batchspec`; `BATCHSPEC_CACHE=off`
(`--no-tuning-cache`) turns it off. Nothing is evicted: a converted GGUF takes its float32 size
(about 5.5x a 4-bit file); delete the directory to reclaim it. Invariants:
- a record is found only under the full key it was written with: the key (every input the value
  depends on) is stored in the record and compared on read, so a hash collision or a foreign file
  is a miss, never a wrong value;
- writes are atomic (a temporary file or directory in the same folder, then one rename), so two
  processes starting at once each see a whole record or none; the last writer wins;
- a corrupt or unreadable record is ignored with a one-line warning, and a cache that cannot be
  written (read-only, full) is a warning too: nothing here ever stops a run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ENV = "BATCHSPEC_CACHE"
OFF = ("off", "none", "0")
#: Bumped when a record's meaning changes: older records are then misses.
FORMAT = 1
#: A converted directory is complete when this file is in it (written last, before the rename).
DONE = "batchspec-complete.json"

_warned: set[str] = set()
#: Process-wide: how many measurements were taken ("measured") and how many reused ("cached").
tally: Counter = Counter()


def root() -> Path | None:
    """The cache directory in force, or None when the cache is off."""
    chosen = os.environ.get(ENV)
    if chosen and chosen.strip().lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchspec"


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def digest(value) -> str:
    """A stable hex digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: str) -> str:
    """A file's SHA-256, read once per process for each identity (path, size, modification time):
    a GGUF's is asked for by the support check, its config and its load."""
    key = file_identity(path)
    if key not in _SHA256:
        with open(path, "rb") as f:
            _SHA256[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _SHA256[key]


_SHA256: dict[str, str] = {}  # file identity -> digest


def file_identity(path: str) -> str:
    """A file's identity without reading it: absolute path, size and modification time."""
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def machine() -> dict:
    """What a timing depends on besides the model: the CPU and its flags, threads, versions."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return _platform() | {"threads": torch.get_num_threads(), "tensor_parallel": world}


@functools.cache
def _platform() -> dict:
    import torch
    import transformers

    from . import __version__

    return {
        "cpu": _cpu_model(),
        "flags": digest(_cpu_flags()),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batchspec": __version__,
    }


def _cpuinfo() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            pairs = (line.split(":", 1) for line in f if ":" in line)
            info = {}
            for name, value in pairs:
                info.setdefault(name.strip(), value.strip())
            return info
    except OSError:
        return {}


def _cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    return sorted(_cpuinfo().get("flags", "").split())


def _record_path(kind: str, key: dict, suffix: str = ".json") -> Path | None:
    base = root()
    return None if base is None else base / kind / f"{digest(key)[:32]}{suffix}"


def read(kind: str, key: dict):
    """The value stored under `key`, or None (no cache, no record, a foreign or corrupt one)."""
    path = _record_path(kind, key)
    if path is None:
        return None
    try:
        if not path.exists():
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
        return record["value"] if _is_of(record, key) else None
    except (OSError, ValueError, KeyError, AttributeError) as err:
        warn_once(f"ignoring the unreadable cache file {path} ({type(err).__name__}); it will be measured again")
        return None


def write(kind: str, key: dict, value) -> None:
    """Store `value` under `key` atomically (a warning, not an error, where it cannot be written)."""
    text = json.dumps({"format": FORMAT, "key": key, "value": value}, default=str, indent=1)
    _put(_record_path(kind, key), text.encode("utf-8"))


def read_bytes(kind: str, key: dict) -> bytes | None:
    """The bytes stored under `key` by `write_bytes`, or None (no cache, no record, a foreign or
    corrupt one). The record's first line is its key, compared on read as `read` compares it."""
    path = _record_path(kind, key, ".bin")
    if path is None or not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return f.read() if _is_of(json.loads(f.readline()), key) else None
    except (OSError, ValueError, AttributeError) as err:
        warn_once(f"ignoring the unreadable cache file {path} ({type(err).__name__}); it will be made again")
        return None


def write_bytes(kind: str, key: dict, data: bytes) -> None:
    """Store `data` under `key` atomically (a warning, not an error, where it cannot be written)."""
    head = json.dumps({"format": FORMAT, "key": key}, default=str).encode() + b"\n"
    _put(_record_path(kind, key, ".bin"), head + data)


def _is_of(record: dict, key: dict) -> bool:
    """Whether a record read back (its format and key) was written under `key`."""
    return record.get("format") == FORMAT and record.get("key") == json.loads(json.dumps(key, default=str))


def _put(path: Path | None, data: bytes) -> None:
    """Write `data` at `path` atomically: a temporary file in the same folder, then one rename
    (nothing where the cache is off; a warning where it cannot be written)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        try:
            os.fchmod(fd, 0o644)  # mkstemp's file is private: let another user (a container's) read it
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
    except OSError as err:
        _cannot_write(err)


def forget(kind: str, key: dict) -> None:
    """Remove the record under `key`, if any (a later read measures again)."""
    path = _record_path(kind, key)
    if path is not None:
        _remove(str(path))


def directory(kind: str, name: str, fill: Callable[[Path], None], key: dict | None = None) -> Path | None:
    """`root/kind/name`, made once by `fill(folder)` into a temporary folder renamed into place;
    with `key`, stored in it and compared as `read` compares (`complete`): one made under another
    key is made again. None when the cache is off or cannot be written (the caller then does
    without it)."""
    base = root()
    if base is None:
        return None
    final = base / kind / name
    try:
        if complete(kind, name, key) is not None:
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{name}-"))
    except OSError as err:
        _cannot_write(err)
        return None
    try:
        fill(tmp)
        tmp.chmod(0o755)  # mkdtemp's folder is private
        (tmp / DONE).write_text(json.dumps({"format": FORMAT, "key": key}, default=str), encoding="utf-8")
        if final.exists() and complete(kind, name, key) is None:
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one left by a killed run, or another key's
        os.rename(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if complete(kind, name, key) is not None:  # another process made it first
            return final
        _cannot_write(err)
        return None
    except BaseException:  # the fill itself failed, or was interrupted: leave nothing half made
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def discard(kind: str, name: str) -> None:
    """Remove `root/kind/name` (a directory `directory` made), if any: a later call makes it again."""
    base = root()
    if base is not None:
        shutil.rmtree(base / kind / name, ignore_errors=True)


def complete(kind: str, name: str, key: dict | None = None) -> Path | None:
    """`root/kind/name` if it was made completely (under `key`, where given), else None."""
    base = root()
    found = None if base is None else base / kind / name
    try:
        if found is None or not (found / DONE).exists():
            return None
        return found if key is None or _is_of(json.loads((found / DONE).read_text(encoding="utf-8")), key) else None
    except (OSError, ValueError, AttributeError):
        return None


def _cannot_write(err: OSError) -> None:
    warn_once(f"the cache directory {root()} cannot be written ({err.strerror or err}); measuring without it")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def model_identity(model) -> dict:
    """What a timing of `model` depends on besides the machine: its class, the shapes, dtypes and
    device of its parameters, and its weights (`model.batchspec_source`, set where it was loaded:
    a file's hash or identity; else a hash of the weights themselves, memoised). The device is its
    type and, on a GPU, its name: the same on every tensor-parallel rank."""
    import torch

    params = [(name, list(p.shape), str(p.dtype), p.device.type) for name, p in model.named_parameters()]
    first = next(model.parameters(), None)
    gpu = torch.cuda.get_device_name(first.device) if first is not None and first.device.type == "cuda" else None
    source = getattr(model, "batchspec_source", None)
    if source is None:  # hashing the weights costs a read of all of them: once per model
        source = model.__dict__.get("_batchspec_weights") or _weights_sha256(model)
        model.__dict__["_batchspec_weights"] = source
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)  # the batch-invariant mode
    return {
        "class": type(model).__name__,
        "source": source,
        "params": digest(params),
        "gpu": gpu,
        "attention": attention,
    }


def _weights_sha256(model) -> str:
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel shard: this rank's part
        h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return "weights:" + h.hexdigest()


def tuning(before) -> str:
    """How the machine's measurements went since `before` (a `tally` copy)."""
    new = tally - before
    if not new["measured"]:
        return "cached" if new["cached"] else "none"
    return "measured" if not new["cached"] else "partly cached"
