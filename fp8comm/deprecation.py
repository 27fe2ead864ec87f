"""Names renamed in 0.2 keep working for one release: the old name resolves to the new object with a warning."""

from __future__ import annotations

import warnings


def renamed(module: str, names: dict[str, tuple[str, object]]):
    """A module __getattr__ serving `old -> (new name, object)` with a FutureWarning naming the replacement."""

    def __getattr__(attr: str):
        if attr in names:
            new, obj = names[attr]
            warnings.warn(
                f"{module}.{attr} is deprecated and will be removed after 0.2; use {new}", FutureWarning, stacklevel=2
            )
            return obj
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")

    return __getattr__
