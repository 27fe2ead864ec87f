"""An engine's private names that an adapter's end-of-job release relies on: each one missing is reported once."""

from __future__ import annotations

import logging


class MissingNames:
    """Call with a private name of `engine` that this release lacks: one warning per name and process, saying that
    the process groups kept there are not released (the names were read on `checked_on`)."""

    def __init__(self, engine: str, checked_on: str, log: logging.Logger) -> None:
        self.engine, self.checked_on, self.log = engine, checked_on, log
        self.reported: set[str] = set()

    def __call__(self, name: str) -> None:
        if name in self.reported:
            return
        self.reported.add(name)
        self.log.warning(
            f"fp8comm: {self.engine} has no {name} (read on {self.engine} {self.checked_on}); the process groups it "
            "kept there are not released, and gloo threads may outlive destroy_process_group()"
        )
