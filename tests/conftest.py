"""Test setup: Triton's interpreter where there is no GPU, a `gpu` marker, the SmolLM2 model folder, and how
pytest-xdist's workers (`make test`) share the host's cores and the modules."""

import gc
import os

# Before torch: ask CUDA through NVML, so checking for a GPU here does not initialize CUDA in this
# process (a process forked after CUDA init cannot use CUDA).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A pytest-xdist worker (`make test` runs two): the host's cores shared out among the workers, for torch's
    # intra-op threads here and in the processes the tests start. Two workers with a thread per core each
    # oversubscribe the host, and torch's spin-waits then cost many times the CPU (2 cores, 2 workers: the suite
    # took 1,750 s of CPU with two threads a worker, 970 s with one, and 1,040 s of wall instead of 550-590 s).
    _share = len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, _share))

import torch  # noqa: E402  (importing torch does not import triton)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must happen before any module defines a @triton.jit kernel; TRITON_INTERPRET=0 opts out.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound with int(array),
    which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream after 3.6): index through element 0."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_scalar_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._pagoda_scalar_index_fix = True


def _skip_nested_lang_patches() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over three modules) at every call of a
    @triton.jit helper inside a kernel, though the launch's own patch of the same modules is in force until the
    launch ends: a third of the sampling kernels' interpreted time. A helper whose language modules the launch
    (or an earlier helper of it) patched skips it; others patch as before."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_nested_patch_fix", False):
        return
    original = interpreter._patch_lang
    patched: list[object] = []  # language modules patched by the running launch; empty between launches

    # a module's language modules, by its globals: (the globals, their size when scanned, the modules); a scan of
    # every global at every helper call was a twentieth of the interpreted kernels' time
    seen: dict[int, tuple[dict[str, object], int, list[object]]] = {}

    def langs_of(fn) -> list[object]:  # noqa: ANN001
        names = fn.__globals__
        known = seen.get(id(names))
        if known is not None and known[0] is names and known[1] == len(names):
            return known[2]
        langs = [v for v in names.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        seen[id(names)] = (names, len(names), langs)
        return langs

    def patch_lang(fn):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        langs = langs_of(fn)
        if patched and all(lang in patched for lang in langs):
            return interpreter._LangPatchScope()  # nothing to restore: the launch's patch covers this call
        launching = not patched
        scope = original(fn)
        patched.extend(langs)
        if launching:  # the launch's scope: its restore ends the launch
            restore = scope.restore

            def restore_and_end() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang
    interpreter._pagoda_nested_patch_fix = True


def _skip_discarded_overflow_checks() -> None:
    """Triton's interpreter computes an overflow check for every signed add, sub and mul on 32-bit or narrower
    integers (the operation again in int64, two compares), then hands it to device_assert, which drops it unless
    debug is on, and the interpreter's options never turn debug on. The check was a fifth of the sampling kernels'
    interpreted time. It is skipped only while debug is off, so what a kernel computes, and any assert it could
    raise, are unchanged."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import dataclasses

    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_overflow_check_fix", False):
        return
    init = interpreter.InterpreterBuilder.__init__

    def no_discarded_checks(builder: interpreter.InterpreterBuilder) -> None:
        if not builder.options.debug:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)

    def patched_init(self: interpreter.InterpreterBuilder) -> None:
        init(self)
        no_discarded_checks(self)

    interpreter.InterpreterBuilder.__init__ = patched_init
    no_discarded_checks(interpreter.interpreter_builder)  # the one built at import
    interpreter._pagoda_overflow_check_fix = True


def _cache_numpy_dtypes() -> None:
    """The interpreter's _get_np_dtype builds its table of 18 numpy dtypes at each of its calls (several per
    interpreted operation: a twelfth of the interpreted kernels' time): the same answers, each looked up once."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_np_dtype_cache", False):
        return
    original = interpreter._get_np_dtype
    pointer = np.dtype(np.uint64)  # a pointer, or a block of pointers, as the original answers
    cache: dict[object, np.dtype] = {}

    def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty  # a block's numpy dtype is its element's
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        try:
            found = cache.get(tt_dtype)
        except TypeError:  # not hashable: not one of the table's, the original's answer (or its error)
            return original(tt_dtype)
        if found is None:
            found = cache[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = get_np_dtype
    interpreter._pagoda_np_dtype_cache = True


def _type_tuples_when_asked() -> None:
    """Every interpreted tensor carries its shape as a triton.language tuple, whose constructor derives the tuple's
    type (a name string over every element type) at once; the interpreter almost never reads it: a fifth of the
    interpreted kernels' time. A tuple built without a type derives it, from the same values, at its first read
    (its values change only through _setitem, which sets the type anew)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.language import core

    if getattr(core, "_pagoda_lazy_tuple_type", False):
        return
    init = core.tuple.__init__

    def lazy_init(self, args, type=None) -> None:  # noqa: ANN001, A002 (the original's signature)
        if type is None:
            self.values = list(args)
        else:
            init(self, args, type)

    def get_type(self) -> core.tuple_type:  # noqa: ANN001
        known = self.__dict__.get("_pagoda_type")
        if known is None:
            known = self.__dict__["_pagoda_type"] = core._type_for_tuple_values(self.values)
        return known

    def set_type(self, value: core.tuple_type) -> None:  # noqa: ANN001
        self.__dict__["_pagoda_type"] = value

    core.tuple.__init__ = lazy_init
    core.tuple.type = property(get_type, set_type)
    core._pagoda_lazy_tuple_type = True


_fix_interpreter_scalar_index()
_skip_nested_lang_patches()
_skip_discarded_overflow_checks()
_cache_numpy_dtypes()
_type_tuples_when_asked()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


# Modules that take minutes on a clean machine, run first (collection order, and the xdist scheduler below) so
# that under pytest-xdist they overlap the rest instead of finishing alone: the sm_90 compile check with an empty
# Triton cache (CI's case) took 228 s of an 830 s suite when it came last (2-core host, two workers).
FIRST_MODULES = ("tests/test_gpu_compile.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """FIRST_MODULES to the front (a stable sort: every other test keeps its order); skip tests marked gpu when no
    CUDA device is present."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST_MODULES)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# the modules that use the session's smollm2_server (below): one work unit for pytest-xdist, so it starts once
SHARED_SERVER_MODULES = ("tests/test_server.py", "tests/test_tools.py", "tests/test_vllm_compat.py",
                         "tests/test_responses.py", "tests/test_anthropic_messages.py",
                         "tests/test_client_libraries.py", "tests/test_stream_equivalence.py",
                         "tests/test_structured_fuzz.py", "tests/test_bad_words.py", "tests/test_protocol_shapes_qa.py",
                         "tests/test_stream_interval.py", "tests/test_render_generate.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it installed, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` (make test) with SHARED_SERVER_MODULES as one unit: a module's tests run on one worker, one
    after the other, so its module-scoped fixtures (servers, loaded models) start once, as without workers."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "smollm2_server" if path in SHARED_SERVER_MODULES else path

        def _assign_work_unit(self, node: object) -> None:
            # xdist queues the units largest (most tests) first: FIRST_MODULES, one long test each, go ahead
            for scope in reversed(FIRST_MODULES):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    return SharedServerFileScheduling(config, log)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _unfreeze_heap():  # noqa: ANN202
    """An in-process engine freezes its start-up objects (pagoda.shared.heap); a test process builds hundreds of
    engines, so each test hands its frozen objects back to the collector when it ends. On a CUDA machine the
    collector also runs then: an engine that sized its KV cache to the free GPU memory (tests/
    test_async_scheduling.py's no-compile test: ~70 GiB) stayed alive until a full collection, so the next module's
    GPU tests ran out of memory (6 paged-attention tests on an H100, session 39). On the CPU the collector's own
    schedule is kept (a collection a test would cost the suite time)."""
    yield
    gc.unfreeze()
    if HAS_CUDA:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="session")
def _smaller_default_cpu_kv_cache() -> None:
    """An engine on the CPU without num_kv_blocks takes min(1 GiB, a quarter of the free RAM) for its KV cache
    (zeroed pages the OS maps as they are used: device.zeroed; torch.zeros had cost ~0.25 s an engine), and the
    scheduler a free list of that many blocks. 512 MiB still holds a whole 8192-token context of SmolLM2 in fp32
    (377 MB) and far more than any test asks of an engine that keeps the default; what the default is was never
    part of a test (it depends on the host's RAM)."""
    from pagoda.services.worker import model_runner

    model_runner.DEFAULT_CPU_KV_BYTES = min(model_runner.DEFAULT_CPU_KV_BYTES, 512 << 20)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # noqa: ANN201  (pagoda's Tokenizer over SmolLM2; imported here lazily)
    """pagoda's Tokenizer over the SmolLM2 folder (the grammar tests'; a module's own `tokenizer` fixture wins)."""
    from pagoda.services.tokenizer.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def ll(tokenizer):  # noqa: ANN001, ANN201  (an llguidance.LLTokenizer)
    """llguidance's tokenizer over `tokenizer` (the grammar tests' masks and walks)."""
    from pagoda.services.grammar.compiler import ll_tokenizer

    return ll_tokenizer(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder: $PAGODA_TEST_MODEL_DIR, else models/ (made if missing)."""
    from pagoda.prepare import is_prepared, prepare_model

    env_dir = os.environ.get("PAGODA_TEST_MODEL_DIR")
    if env_dir:
        path = Path(env_dir)
        if not is_prepared(path):
            pytest.fail(f"PAGODA_TEST_MODEL_DIR={env_dir} is not a finished model folder")
        return path
    return prepare_model("smollm2", REPO_ROOT / "models")


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir: Path):  # noqa: ANN201  (an Iterator[tests.harness.Server])
    """`pagoda serve` with SmolLM2 and the default settings, started once for the modules that need nothing
    else (SHARED_SERVER_MODULES); none of their tests changes what the others see. One setting differs:
    --max-logprobs -1 (vLLM's tests also lift it), so that a request may ask for the whole vocabulary's logprobs;
    requests asking for 20 or fewer are served as with the default."""
    from tests.harness import running_server

    with running_server(smollm2_dir, "--max-logprobs", "-1") as server:
        yield server
