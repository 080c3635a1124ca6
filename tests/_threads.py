"""A test helper: run a function in several threads at once and fail the test with the first error any raised."""
from __future__ import annotations

import threading


def run_in_threads(work, args) -> None:
    """``work(a)`` for every ``a`` of ``args``, each in its own thread, all started before any is joined (kernels
    release the GIL, so they run at the same time); the first exception a thread raised is raised here."""
    errors = []

    def body(a):
        try:
            work(a)
        except BaseException as e:   # noqa: BLE001 (re-raised in the calling thread)
            errors.append(e)
    threads = [threading.Thread(target=body, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
