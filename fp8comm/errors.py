"""The errors fp8comm raises: every one derives from Fp8CommError, so `except fp8comm.Fp8CommError` catches them all.

Fp8CommError is a ValueError (bad input is the common case); the subclasses that stand for a wrong type, an
unavailable kernel or an unsupported setup are also the matching built-in (TypeError, RuntimeError, ...), so code
written against the built-ins keeps working.
"""

from __future__ import annotations


class Fp8CommError(ValueError):
    """Base of every error fp8comm raises; as a ValueError: bad input, raised before any payload bytes move."""


class Fp8CommConfigError(Fp8CommError):
    """A configuration (wire options, an engine's fp8comm section or flags) that cannot be honoured."""


class CommMismatchError(Fp8CommError):
    """Ranks disagree on a collective's metadata (sizes, dtypes, splits, options); raised on every rank."""


class Fp8CommTypeError(Fp8CommError, TypeError):
    """An argument of the wrong type (a float8 tensor where the high-precision one is needed, a non-tensor...)."""


class Fp8CommRuntimeError(Fp8CommError, RuntimeError):
    """Something the environment cannot do (a kernel backend that is not available on this device)."""


class Fp8CommNotImplementedError(Fp8CommError, NotImplementedError):
    """A combination a backend does not implement (the GEMM router then takes the next backend)."""


class Fp8CommUnsupportedError(Fp8CommError, RuntimeError):
    """An engine version or configuration the integration does not support; nothing was changed."""


class Fp8CommStateError(Fp8CommError, RuntimeError):
    """Installed hooks and what is being built disagree (different settings, hooks already installed)."""


class Fp8CommCaptureError(Fp8CommError, RuntimeError):
    """An fp8comm collective (or a handle's wait) inside CUDA graph capture: refused before anything is queued,
    since its scratch memory, host-side checks and multi-phase steps cannot be replayed safely."""


class Fp8CommFallbackWarning(UserWarning):
    """A warning, not an error: backend 'auto' runs a slower kernel path than usual on this machine (the same bits);
    the message names the cause (no native kernels, no C++ compiler for inductor). Given once per cause."""
