"""ONNX Runtime's C API through ctypes: sessions that share one pre-packed copy of each weight.

ONNX Runtime pre-packs a MatMul / Gemm / MatMulNBits weight into the layout its kernels read (MLAS), and by
default every session keeps its own packed copy: an engine with five step graphs holds its weights five
times over. The C API's OrtPrepackedWeightsContainer lets sessions share them: a weight given to a session
with AddInitializer is packed, looked up in the container by its packed content, and a copy already there is
used instead (the new one is freed). The Python API does not expose the container, so the CPU sessions that
pre-pack are made here, over the C library the onnxruntime wheel ships (capi/libonnxruntime.so), with only
the calls the onnxruntime backend needs: session options, AddInitializer, sessions with the container,
tensors over numpy memory, IOBinding and RunWithBinding.

  container = PrepackedWeightsContainer()          # one per process (shared by every engine)
  so = SessionOptions(threads=2, config={...}); so.add_initializer(name, array)   # array outlives sessions
  sess = Session(path, so, container)
  io = sess.io_binding(); io.bind_input(name, array); io.bind_output(name, array); io.run()

Arrays are bound without a copy (an output is written into the array; an input that is not C-contiguous is
copied once, when its Value is made). Every handle keeps the objects it
needs alive (a session its options and their initializers, a binding its session and bound values), and a
non-NULL OrtStatus becomes an OrtError carrying ONNX Runtime's message.

`available()` says whether the library loads here: the struct OrtApi offsets below are those of the C header
(append-only across versions, so a newer library keeps them); the table is asked for at API version 20, the
oldest onnxruntime (1.20) specexport supports: every function used is in it (the last, index 168, since 1.8).
"""

from __future__ import annotations

import ctypes as C
import glob
import importlib.util
import os
import threading

import numpy as np

API_VERSION = 20
# offsets of the functions used, in struct OrtApi (include/onnxruntime/core/session/onnxruntime_c_api.h)
_INDEX = dict(GetErrorCode=1, GetErrorMessage=2, CreateEnv=3, CreateSession=7, CreateSessionOptions=10,
              SetSessionGraphOptimizationLevel=23, SetIntraOpNumThreads=24, CreateTensorWithDataAsOrtValue=49,
              CreateCpuMemoryInfo=69, ReleaseEnv=92, ReleaseStatus=93, ReleaseMemoryInfo=94, ReleaseSession=95,
              ReleaseValue=96, ReleaseSessionOptions=100, AddSessionConfigEntry=130, RunWithBinding=133,
              CreateIoBinding=134, ReleaseIoBinding=135, BindInput=136, BindOutput=137, AddInitializer=150,
              CreatePrepackedWeightsContainer=166, ReleasePrepackedWeightsContainer=167,
              CreateSessionWithPrepackedWeightsContainer=168)
_ELEM = {np.dtype(t): code for t, code in ((np.float32, 1), (np.uint8, 2), (np.int8, 3), (np.int32, 6),
                                           (np.int64, 7), (np.bool_, 9), (np.float16, 10), (np.float64, 11))}
_LOG_ERROR, _ENABLE_ALL, _ARENA_ALLOCATOR, _MEM_DEFAULT = 3, 99, 1, 0
VP = C.c_void_p


class OrtError(RuntimeError):
    pass


class _Api:
    """The loaded library's function table (loaded once, on first use)."""

    def __init__(self):
        spec = importlib.util.find_spec("onnxruntime")
        if spec is None or not spec.submodule_search_locations:
            raise OrtError("onnxruntime is not installed")
        found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "capi", "libonnxruntime.so*")))
        if not found:
            raise OrtError("this onnxruntime wheel ships no libonnxruntime.so")
        lib = C.CDLL(found[-1])

        class Base(C.Structure):
            _fields_ = [("GetApi", C.CFUNCTYPE(VP, C.c_uint32)), ("GetVersionString", C.CFUNCTYPE(C.c_char_p))]
        lib.OrtGetApiBase.restype = C.POINTER(Base)
        base = lib.OrtGetApiBase().contents
        self.version = base.GetVersionString().decode()
        api = base.GetApi(API_VERSION)
        if not api:
            raise OrtError(f"libonnxruntime {self.version} has no C API version {API_VERSION}")
        self._table = C.cast(api, C.POINTER(VP))
        f = self._fn
        self.error_code, self.error_message = f("GetErrorCode", C.c_int, VP), f("GetErrorMessage", C.c_char_p, VP)
        self.release_status = f("ReleaseStatus", None, VP)
        for name in _INDEX:
            if name.startswith("Release"):
                setattr(self, name, f(name, None, VP))
        s = self._checked
        self.CreateEnv = s("CreateEnv", C.c_int, C.c_char_p, C.POINTER(VP))
        self.CreateSessionOptions = s("CreateSessionOptions", C.POINTER(VP))
        self.SetIntraOpNumThreads = s("SetIntraOpNumThreads", VP, C.c_int)
        self.SetSessionGraphOptimizationLevel = s("SetSessionGraphOptimizationLevel", VP, C.c_int)
        self.AddSessionConfigEntry = s("AddSessionConfigEntry", VP, C.c_char_p, C.c_char_p)
        self.AddInitializer = s("AddInitializer", VP, C.c_char_p, VP)
        self.CreatePrepackedWeightsContainer = s("CreatePrepackedWeightsContainer", C.POINTER(VP))
        self.CreateSession = s("CreateSession", VP, C.c_char_p, VP, C.POINTER(VP))
        self.CreateSessionWithPrepackedWeightsContainer = s("CreateSessionWithPrepackedWeightsContainer", VP,
                                                            C.c_char_p, VP, VP, C.POINTER(VP))
        self.CreateCpuMemoryInfo = s("CreateCpuMemoryInfo", C.c_int, C.c_int, C.POINTER(VP))
        self.CreateTensorWithDataAsOrtValue = s("CreateTensorWithDataAsOrtValue", VP, VP, C.c_size_t,
                                                C.POINTER(C.c_int64), C.c_size_t, C.c_int, C.POINTER(VP))
        self.CreateIoBinding = s("CreateIoBinding", VP, C.POINTER(VP))
        self.BindInput = s("BindInput", VP, C.c_char_p, VP)
        self.BindOutput = s("BindOutput", VP, C.c_char_p, VP)
        self.RunWithBinding = s("RunWithBinding", VP, VP, VP)  # (the GIL is released during calls)
        self.env = self.new(self.CreateEnv, _LOG_ERROR, b"specexport")
        self.cpu = self.new(self.CreateCpuMemoryInfo, _ARENA_ALLOCATOR, _MEM_DEFAULT)

    def _fn(self, name, restype, *argtypes):
        return C.CFUNCTYPE(restype, *argtypes)(self._table[_INDEX[name]])

    def _checked(self, name, *argtypes):
        fn = self._fn(name, VP, *argtypes)

        def call(*args):
            status = fn(*args)
            if status:
                message, code = self.error_message(status).decode(errors="replace"), self.error_code(status)
                self.release_status(status)
                raise OrtError(f"{message} (onnxruntime error {code})")
        return call

    @staticmethod
    def new(create, *args) -> int:
        """Call a Create* function whose last argument is the out-pointer; return the handle."""
        h = VP()
        create(*args, C.byref(h))
        return h.value


_api: _Api | None = None
_load_error: str | None = None
_lock = threading.Lock()


def api() -> _Api:
    global _api, _load_error
    with _lock:
        if _api is None and _load_error is None:
            try:
                _api = _Api()
            except (OSError, OrtError, AttributeError) as e:
                _load_error = str(e)
    if _api is None:
        raise OrtError(f"ONNX Runtime's C library cannot be used here: {_load_error}")
    return _api


def available() -> bool:
    try:
        api()
        return True
    except OrtError:
        return False


class _Handle:
    _release = ""

    def close(self):
        h, self._h = getattr(self, "_h", None), None
        if h and _api is not None:
            getattr(_api, self._release)(h)

    def __del__(self):
        self.close()


class Value(_Handle):
    """A tensor over a numpy array's memory (no copy); holds the array. writeable: the array is an output."""
    _release = "ReleaseValue"

    def __init__(self, array: np.ndarray, writeable: bool = False):
        a = np.asarray(array)
        if a.dtype not in _ELEM:
            raise TypeError(f"no ONNX tensor type for {a.dtype}")
        if not a.flags.c_contiguous or (writeable and not a.flags.writeable):
            if writeable:
                raise ValueError("an output array must be C-contiguous and writeable")
            a = np.ascontiguousarray(a)
        self.array = a
        shape = (C.c_int64 * max(a.ndim, 1))(*a.shape)
        self._h = api().new(api().CreateTensorWithDataAsOrtValue, api().cpu, a.ctypes.data, a.nbytes, shape, a.ndim,
                            _ELEM[a.dtype])


class SessionOptions(_Handle):
    _release = "ReleaseSessionOptions"

    def __init__(self, threads: int | None = None, config: dict[str, str] | None = None):
        a = api()
        self._h = a.new(a.CreateSessionOptions)
        self.initializers: dict[str, Value] = {}  # must outlive every session made with these options
        if threads:
            a.SetIntraOpNumThreads(self._h, int(threads))
        a.SetSessionGraphOptimizationLevel(self._h, _ENABLE_ALL)
        for key, value in (config or {}).items():
            a.AddSessionConfigEntry(self._h, key.encode(), str(value).encode())

    def add_initializer(self, name: str, value: "Value | np.ndarray") -> None:
        value = value if isinstance(value, Value) else Value(value)
        api().AddInitializer(self._h, name.encode(), value._h)
        self.initializers[name] = value


class PrepackedWeightsContainer(_Handle):
    """Pre-packed weights shared by the sessions made with it (those given with add_initializer)."""
    _release = "ReleasePrepackedWeightsContainer"

    def __init__(self):
        self._h = api().new(api().CreatePrepackedWeightsContainer)

    def close(self):  # the packed copies go: give their heap pages back too (glibc keeps freed blocks resident)
        had = getattr(self, "_h", None)
        super().close()
        if had:
            _trim_heap()


class Session(_Handle):
    _release = "ReleaseSession"

    def __init__(self, path: str, options: SessionOptions, container: PrepackedWeightsContainer | None = None):
        a = api()
        self._options, self._container = options, container  # released after the session
        if container is None:
            self._h = a.new(a.CreateSession, a.env, os.fsencode(path), options._h)
        else:
            self._h = a.new(a.CreateSessionWithPrepackedWeightsContainer, a.env, os.fsencode(path), options._h,
                            container._h)
        _trim_heap()

    def io_binding(self) -> "IoBinding":
        return IoBinding(self)


class IoBinding(_Handle):
    _release = "ReleaseIoBinding"

    def __init__(self, session: Session):
        self._session = session
        self._h = api().new(api().CreateIoBinding, session._h)
        self._bound: dict[tuple[str, str], Value] = {}  # the bound values stay alive while bound

    def bind_input(self, name: str, value: "Value | np.ndarray") -> None:
        value = value if isinstance(value, Value) else Value(value)
        api().BindInput(self._h, name.encode(), value._h)
        self._bound["in", name] = value

    def bind_output(self, name: str, value: "Value | np.ndarray") -> None:
        value = value if isinstance(value, Value) else Value(value, writeable=True)
        api().BindOutput(self._h, name.encode(), value._h)
        self._bound["out", name] = value

    def run(self) -> None:
        api().RunWithBinding(self._session._h, None, self._h)


def _trim_heap() -> None:
    """Return freed heap pages to the system after a session is made: with the container, each session still
    packs every weight into a temporary buffer and frees it when the container already holds that copy, and
    glibc keeps such freed blocks resident unless trimmed (measured: one packed copy per session otherwise)."""
    try:
        C.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
