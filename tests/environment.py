"""Environment the suite sets before torch is imported (conftest.py), importable by tests without running
conftest's module code a second time."""


def worker_threads(environ) -> dict[str, str]:
    """The thread variables a pytest-xdist worker sets: one torch thread each, as two workers of two threads on
    2 cores would thrash; none outside a worker."""
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if environ.get("PYTEST_XDIST_WORKER") else {}
