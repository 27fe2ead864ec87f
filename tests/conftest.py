import importlib.util
import os

import pytest
import torch

# Keep the 2-core CI machine responsive: one intra-op thread per test process.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# In CI (CI=true) a skip is a failure unless it is listed here: {test id prefix: the skip reason it must give}.
# A broken install (deepspeed or megatron-core missing, no network namespaces) would otherwise turn whole modules
# into skips that read like a green run. Keep each entry's why beside it.
ALLOWED_SKIPS: dict[str, str] = {}


def _allowed(nodeid: str, reason: str) -> bool:
    return any(nodeid.startswith(prefix) and want in reason for prefix, want in ALLOWED_SKIPS.items())


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


_unlisted: list[str] = []


def _note_skip(report) -> None:
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reason = _skip_reason(report)
    if not _allowed(report.nodeid, reason):
        _unlisted.append(f"{report.nodeid or '<collection>'}: {reason}")


if importlib.util.find_spec("xdist") is not None:  # the hook exists only with pytest-xdist installed

    def pytest_xdist_make_scheduler(config, log):
        """test.sh runs the test files on parallel workers (--dist loadfile): each file stays on one worker, so its
        module-scoped launches start once; the simulated-cluster files form one unit (one cluster at a time)."""
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class FileScheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return "tests/cluster/" if path.startswith("tests/cluster/") else path

        return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    # Every multi-process test shares a torchrun launch whose start-up alone (interpreters, torch, gloo rendezvous)
    # takes 10-30 s on 2 cores: `dist` implies `slow`, so `-m "not slow"` is the single-process fast tier.
    for item in items:
        if item.get_closest_marker("dist") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def pytest_collectreport(report) -> None:
    if report.skipped:  # module-level importorskip / pytest.skip(allow_module_level=True)
        _note_skip(report)


def pytest_runtest_logreport(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _note_skip(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _unlisted and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _unlisted:
        terminalreporter.section("skips not on tests/conftest.py's ALLOWED_SKIPS (CI=true: the run fails)")
        for line in _unlisted:
            terminalreporter.write_line(line)


@pytest.fixture
def all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern once (+-0, subnormals, max finite, +-inf, NaNs), as a [512, 128] tensor."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128)
