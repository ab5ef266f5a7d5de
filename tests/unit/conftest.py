"""Unit-suite fixtures.

Under mutmut (MUTANT_UNDER_TEST is set) qualify.hashing is mutmut's instrumented copy, which imports
mutmut's trampoline. Its worker processes are `python -I -S` interpreters that see no site-packages, so
there they would die at import and every worker's share would be hashed by the fallback in the calling
process: the worker code path would go unjudged and the progress count wrong. This gives the workers
mutmut's own directory (appended: nothing else of site-packages is shadowed), in tests and only under
mutmut; qualify.hashing is not changed (TESTING.md, mutation testing).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _hash_workers_import_mutmut_under_mutation():
    if "MUTANT_UNDER_TEST" not in os.environ:
        yield
        return
    import mutmut

    from qualify import hashing

    site = os.path.dirname(os.path.dirname(os.path.abspath(mutmut.__file__)))
    original = hashing._WORKER_CODE
    hashing._WORKER_CODE = f"import sys; sys.path.append({site!r}); " + original
    try:
        yield
    finally:
        hashing._WORKER_CODE = original
