"""Shared fixtures: a toy GQA decoder, its eager oracle, and .pte files lowered once per session.

AOTInductor compiles take 15-25 s on a 2-core machine, so every distinct
(storage dtype, policy) export happens once and is shared by all tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, Sequence, Tuple

# One OpenMP thread per step unless a test asks for more (num_threads): the
# runtime's default gives a prefill chunk the cores no other process is using
# at that moment, and MKL's sums on 1 and on 2 threads differ in the last bit,
# so on a machine whose load changes (CI beside other jobs) the tests that
# compare two runs bit for bit would compare different thread counts. Set
# before torch loads libgomp, which reads it once; inherited by child processes.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# AOTI checks inputs against the compiled bounds only when asked to.
os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
# Without a GPU the Triton kernels' tests run through Triton's CPU interpreter;
# triton reads the flag when a kernel is defined, so before anything imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "llama"))

import offgraph_kv.runtime  # noqa: E402,F401  (registers the backend)
from executorch.exir import to_edge_transform_and_lower  # noqa: E402
from executorch.extension.llm.cache.reference_cache import (  # noqa: E402
    CacheConfig,
    ContiguousReferenceCache,
    LayerPolicy,
)
from executorch.extension.llm.cache.update_and_attend import REGISTRY  # noqa: E402
from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic, positions  # noqa: E402

from offgraph_kv.partitioner import OffGraphKVPartitioner  # noqa: E402

TOY = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32)
MAX_WRITE = 32


def toy_model(args: ModelArgs = TOY, seed: int = 0) -> Transformer:
    return init_deterministic(Transformer(args), seed=seed).eval()


def lower(model: torch.nn.Module, export_bound: int = MAX_WRITE, **partitioner: object) -> bytes:
    """Export with step widths up to ``export_bound`` and lower with the given partitioner arguments."""
    ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(export_bound))
    prog = to_edge_transform_and_lower(ep, partitioner=[OffGraphKVPartitioner(**partitioner)])
    return prog.to_executorch().buffer


class Oracle:
    """The eager model over ExecuTorch's ContiguousReferenceCache."""

    _count = 0

    def __init__(self, model: Transformer, storage_dtype: torch.dtype, layers: Sequence[LayerPolicy] = (LayerPolicy.flat(),),
                 capacity: int = 4096) -> None:
        a = model.args
        Oracle._count += 1
        self.key = f"oracle{Oracle._count}"
        self.model = model
        self.cache = ContiguousReferenceCache(CacheConfig(
            n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, capacity=capacity,
            dtype=storage_dtype, layers=tuple(layers)))
        REGISTRY.install(self.key, self.cache)
        self.length = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        w = tokens.shape[1]
        with REGISTRY.active(self.key), torch.no_grad():
            out = self.model(tokens, positions(self.length, w))
        self.length += w
        return out

    def reset(self) -> None:
        self.cache.reset()
        self.length = 0


class Session:
    """A loaded method plus the length the caller believes it holds."""

    def __init__(self, pte_path: Path) -> None:
        # executorch.runtime, or the C++ Module under another torch (the H200 image).
        self.method = offgraph_kv.runtime.load_method(pte_path)
        self.store = offgraph_kv.runtime.stores()[-1]
        self.length = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        w = tokens.shape[1]
        out = self.method.execute([tokens, positions(self.length, w)])[0]
        self.length += w
        return out


@contextlib.contextmanager
def configured(**policy: object) -> Iterator[None]:
    """A load-time policy (backend options) for the loads inside; the defaults after."""
    offgraph_kv.runtime.configure(**policy)
    try:
        yield
    finally:
        offgraph_kv.runtime.configure()


def load_configured(pte_path: Path, **policy: object) -> Session:
    """Load with a load-time policy, restoring the defaults after."""
    with configured(**policy):
        return Session(pte_path)


# The real checkpoint's exports (tests/test_real_checkpoint.py) take minutes
# each: started when collection ends, beside the tests (background_exports.py).
SMOLLM2_EXPORTS = [(f"smollm2_{storage}", ["--dtype", "fp32", "--storage-dtype", storage, "--initial-capacity", "64",
                                          "--quiet"]) for storage in ("fp32", "bf16")]


def _start_smollm2_exports(config: pytest.Config) -> object:
    import gguf_import

    found = gguf_import.smollm2_gguf_path()
    if found is None:
        return None  # the fixture fails, naming the missing wheel
    from background_exports import BackgroundExports

    exports = BackgroundExports([(name, ["--gguf", str(found), *argv]) for name, argv in SMOLLM2_EXPORTS])
    config.stash[_BACKGROUND] = exports
    return exports


def pytest_collection_finish(session: pytest.Session) -> None:
    # An xdist worker collects every test but runs only some: it starts the
    # exports when one of its tests asks (the fixture below), not here.
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    if any("smollm2_pte" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_smollm2_exports(session.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    exports = session.config.stash.get(_BACKGROUND, None)
    if exports is not None:
        exports.close()


_BACKGROUND = pytest.StashKey["object"]()


@pytest.fixture(scope="session")
def background_exports(request: pytest.FixtureRequest) -> object:
    """The session's BackgroundExports of the SmolLM2 programs, started now if the
    session did not start them (None without the checkpoint)."""
    exports = request.config.stash.get(_BACKGROUND, None)
    return exports if exports is not None else _start_smollm2_exports(request.config)


@pytest.fixture(scope="session")
def model() -> Transformer:
    return toy_model()


@pytest.fixture(scope="session")
def pte_factory(tmp_path_factory: pytest.TempPathFactory, model: Transformer) -> Callable[..., Path]:
    """Lower the toy model once per distinct set of partitioner arguments."""
    cache: Dict[Tuple, Path] = {}
    root = tmp_path_factory.mktemp("pte")

    def make(**kwargs: object) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            path = root / f"toy_{len(cache)}.pte"
            path.write_bytes(lower(model, **kwargs))
            cache[key] = path
        return cache[key]

    return make


# A model with ~135 MB of fp32 weights: large enough that a copy of the weights
# would stand out against torch's own RSS noise, small enough to export in CI.
MEDIUM = ModelArgs(dim=512, n_layers=6, n_heads=8, n_kv_heads=2, vocab_size=16384, multiple_of=256)


@pytest.fixture(scope="session")
def medium_pte(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, int]:
    """The MEDIUM model lowered once per session (fp32 KV, initial capacity 256): its path and weight bytes."""
    model = init_deterministic(Transformer(MEDIUM), seed=3).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = tmp_path_factory.mktemp("medium") / "medium.pte"
    path.write_bytes(lower(model, storage_dtype=torch.float32, initial_capacity=256))
    return path, weight_bytes


def generate_checked(session: "Session", oracle: Oracle, chunks: Sequence[Tuple[int, int]], tol: float,
                     steps: int = 60) -> "Tuple[list, list]":
    """Prefill ``prompt(11)`` in the given chunks, then ``steps`` greedy decode
    steps, each checked against the oracle; the logits and the store's tensor
    addresses after every decode step."""
    outs, addresses = [], [session.store.addresses()]
    tokens = prompt(11)
    for start, end in chunks:
        got, want = session.step(tokens[:, start:end]), oracle.step(tokens[:, start:end])
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        outs.append(got)
    nxt = greedy(got)
    for _ in range(steps):
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        outs.append(got)
        addresses.append(session.store.addresses())
        nxt = greedy(got)
    return outs, addresses


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1:].argmax(-1)


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TOY.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
