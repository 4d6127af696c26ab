"""Native CPU kernels for the longest chains of tiny ops in our model, bit-identical to those ops.

mHC's Sinkhorn normalisation is 117 torch ops per call on [..., 4, 4] matrices (8 calls per token of the
tiny model): 40% of a rollout decode step's ops and, with autograd's backward, 41% of a training step's.
`sinkhorn` runs the same float32 additions and divisions in the same order in C (kernels.c), one call per
batch, and its gradient is one more call that recomputes the forward steps and applies autograd's formulas
in autograd's order, so results and gradients are bit-identical to the torch ops'. Our model uses it
(engines/model/layers.py) and so does the trainer's transformers model (engines/train/hf_model.py
`use_native_mhc`).

The library is compiled from kernels.c with the system C compiler ($CC, default `cc`) on first use
(about 0.1 s), cached as `<cache>/libv4rl_kernels-<hash>.so` (cache: $V4RL_KERNEL_CACHE, else
$XDG_CACHE_HOME/v4rl/kernels, else ~/.cache/v4rl/kernels; the hash covers the source, the compiler
and its flags) and loaded with ctypes, which releases the GIL during a call. The .so is written under a
temporary name and renamed, so concurrent processes never load a half-written file.

Before a kernel is used for matrices of a given size, it is compared with the torch ops (its gradient with
autograd's) on random inputs: any difference (another torch version may reduce in another order) or no
usable compiler means the torch ops are used instead, with one warning that says why and how to fix it.
Nothing changes numerically either way; only speed. V4RL_NATIVE_KERNELS=0 turns the kernels off.

`NativeLibrary` is the build-and-load machinery; fused.py uses it for the fused prefill/decode kernels, which
are checked within a bound instead (their sums run in another order), and `status()` reports both.

    from engines.model import kernels
    kernels.status()                 # {"enabled": True, "library": "...so", "error": None, "verified": {4: True}}
    .venv/bin/python -m pytest tests/test_kernels.py -q
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("v4rl.kernels")
SOURCE = Path(__file__).with_name("kernels.c")
HEADERS = (SOURCE.with_name("sinkhorn.h"),)
CFLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
"""No fused multiply-add and no reassociation: both would round differently from torch."""
BUILD_TIMEOUT_S = 120


def enabled() -> bool:
    return os.environ.get("V4RL_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("V4RL_KERNEL_CACHE"):
        return Path(os.environ["V4RL_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "v4rl" / "kernels"


def _cpu_identity() -> bytes:
    """What `-march=native` compiles for: the CPU's feature flags (a cache shared by other CPUs must not reuse it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def build(out_dir: Path | None = None, *, sources: tuple[Path, ...] = (SOURCE,), cflags: tuple[str, ...] = CFLAGS,
          headers: tuple[Path, ...] = HEADERS) -> Path:
    """Compile `sources` into one library in `out_dir` (default cache_dir()) unless the same build is there (the key
    covers the sources, the headers they include, the compiler, its flags and the machine); returns the .so."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC to a C compiler)")
    parts = [f.read_bytes() for f in (*sources, *headers)]
    parts += [compiler.encode(), " ".join(cflags).encode(), platform.machine().encode()]
    if "-march=native" in cflags:
        parts.append(_cpu_identity())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    target = out_dir / f"libv4rl_{sources[0].stem}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=out_dir)
    os.close(fd)
    names = " ".join(str(f) for f in sources)
    try:
        proc = subprocess.run([compiler, *cflags, *map(str, sources), "-o", tmp, "-lm", "-lpthread"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed to compile {names} (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[:2000]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{compiler} did not compile {names} within {BUILD_TIMEOUT_S} s") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


Signature = tuple[Any, list[Any]]
"""(restype, argtypes) of one exported C function."""


class NativeLibrary:
    """C sources compiled into one library on first use (the first flag set that compiles), loaded once per process
    with the given signatures; a build or load failure is remembered and logged once as a warning."""

    def __init__(self, sources: tuple[Path, ...], flag_sets: tuple[tuple[str, ...], ...],
                 signatures: dict[str, Signature], headers: tuple[Path, ...] = ()) -> None:
        self.sources, self.headers, self.flag_sets, self.signatures = sources, headers, flag_sets, signatures
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.path: str | None = None
        self.error: str | None = None
        self._loaded = False

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    lib = ctypes.CDLL(str(self._build()))
                    for name, (restype, argtypes) in self.signatures.items():
                        fn = getattr(lib, name)
                        fn.restype, fn.argtypes = restype, argtypes
                    self.lib, self.path = lib, lib._name
                except (OSError, RuntimeError, AttributeError) as exc:
                    self.error = str(exc)
                    log.warning("native kernels of %s unavailable, using torch ops: %s", self.sources[0].name, exc)
        return self.lib

    def _build(self) -> Path:
        for i, flags in enumerate(self.flag_sets):
            try:
                return build(sources=self.sources, cflags=flags, headers=self.headers)
            except RuntimeError:
                if i == len(self.flag_sets) - 1:
                    raise
        raise RuntimeError(f"no flag set given for {self.sources[0]}")


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_sinkhorn_library = NativeLibrary((SOURCE,), (CFLAGS,), headers=HEADERS, signatures={
    "v4rl_sinkhorn": (None, [_P, _I64, _I64, _I64, _F32]),
    "v4rl_sinkhorn_backward": (_INT, [_P, _P, _P, _I64, _I64, _I64, _F32]),
})
_verified: dict[int, bool] = {}


def _load() -> ctypes.CDLL | None:
    return _sinkhorn_library.load()


def reset() -> None:
    """Forget the loaded libraries and every check (tests: after changing the environment)."""
    from engines.model import fused

    _sinkhorn_library.reset()
    _verified.clear()
    fused.reset()


def status() -> dict[str, Any]:
    """What the kernels are doing in this process (for benchmarks and /server_info)."""
    from engines.model import fused

    return {"enabled": enabled(), "library": _sinkhorn_library.path, "error": _sinkhorn_library.error,
            "verified": dict(_verified), "fused_decode": fused.status()}


# ---------------------------------------------------------------------------------------------- Sinkhorn
def sinkhorn_applies(comb: torch.Tensor, reference: Callable[[torch.Tensor, int, float], torch.Tensor]) -> bool:
    """Whether `sinkhorn` may replace `reference` (the torch ops) for these matrices: fp32 on the CPU and the
    kernels built and checked bit-identical to `reference` for this matrix size, forward and gradient."""
    if (comb.dtype != torch.float32 or comb.device.type != "cpu" or comb.dim() < 2
            or comb.shape[-1] != comb.shape[-2] or not enabled()):
        return False
    n = comb.shape[-1]
    if n not in _verified:
        _verified[n] = _load() is not None and _check_sinkhorn(n, reference)
    return _verified[n]


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The kernel (call `sinkhorn_applies` first): a new tensor, `comb` left as it was; differentiable."""
    if comb.requires_grad and torch.is_grad_enabled():
        return _Sinkhorn.apply(comb, iters, eps)
    return _sinkhorn_forward(comb, iters, eps)


def _sinkhorn_forward(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    out = comb.detach().clone(memory_format=torch.contiguous_format)
    n = comb.shape[-1]
    if out.numel():
        _sinkhorn_library.lib.v4rl_sinkhorn(out.data_ptr(), out.numel() // (n * n), n, iters, eps)
    return out


class _Sinkhorn(torch.autograd.Function):
    """Native forward; native backward recomputing the forward steps from the saved input (no activations)."""

    @staticmethod
    def forward(ctx, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(comb)
        ctx.iters, ctx.eps = iters, eps
        return _sinkhorn_forward(comb, iters, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (comb,) = ctx.saved_tensors
        comb, grad = comb.contiguous(), grad.to(torch.float32).contiguous()
        out = torch.empty_like(comb)
        n = comb.shape[-1]
        if out.numel() and _sinkhorn_library.lib.v4rl_sinkhorn_backward(comb.data_ptr(), grad.data_ptr(), out.data_ptr(),
                                                           out.numel() // (n * n), n, ctx.iters, ctx.eps) != 0:
            raise MemoryError(f"v4rl_sinkhorn_backward could not allocate its scratch ({n}x{n}, {ctx.iters} iters)")
        return out, None, None


def _check_sinkhorn(n: int, reference: Callable[[torch.Tensor, int, float], torch.Tensor]) -> bool:
    g = torch.Generator().manual_seed(n)
    # The first use may come under inference_mode or autocast; the check needs autograd and plain fp32.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        for shape in ((1, n, n), (64, 1, n, n), (64, 29, n, n), (3, 257, n, n)):
            comb = (torch.softmax(3 * torch.randn(shape, generator=g), dim=-1) + 1e-6).requires_grad_()
            grad_out = torch.randn(shape, generator=g)
            for iters, eps in ((20, 1e-6), (3, 1e-3)):
                want = reference(comb, iters, eps)
                (want_grad,) = torch.autograd.grad(want, comb, grad_out)
                got = sinkhorn(comb, iters, eps)
                (got_grad,) = torch.autograd.grad(got, comb, grad_out)
                for what, a, b in (("result", want, got), ("gradient", want_grad, got_grad)):
                    if not torch.equal(a, b):
                        log.warning("native sinkhorn's %s differs from the torch ops' for %dx%d matrices (%d of %d "
                                    "values, shape %s, iters %d): using the torch ops. Report this with your torch "
                                    "version (%s)", what, n, n, (a != b).sum().item(), a.numel(), tuple(shape), iters,
                                    torch.__version__)
                        return False
    return True
