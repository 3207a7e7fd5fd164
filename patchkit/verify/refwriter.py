"""The merged references written in a thread of their own while the first engines run.

A `verify --model` run writes each adapter's merged checkpoint and rounding control
(references.write_references): on the 35B-A3B-wide cut 25.1 GiB, 91-116 s on the test
H100, during which no engine ran (2026-12-07), though only the reference engines read
them. Written here meanwhile, the LoRA engines and the base ones start at once, and a
reference engine takes a slot of serving.pool only once its checkpoint is complete
(ready). The writing is torch and file I/O, which leave the GIL to the pool's polling.
"""

from __future__ import annotations

import threading
from pathlib import Path

from patchkit.verify import references

# How long close() waits for the thread before it says that it waits (seconds): the
# thread stops before the next tensor, and one tensor of a wide MoE's experts is written
# in a few seconds.
STOP_WAIT_S = 10.0


class ReferenceWriter:
    """write_references in a thread: ``paths`` at once, ``ready(job)`` for the pool."""

    def __init__(self, plans: dict, workdir: Path, say, seed: int):
        self.paths = references.reference_paths(plans, workdir)
        # the models the reference engines read, as their jobs name them
        self._readers = {str(path) for kinds in self.paths.values() for path in kinds.values()}
        self._say = say
        self._written: set[str] = set()
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(
            target=self._write, args=(plans, workdir, say, seed), name="patchkit-references"
        )
        self._thread.start()

    def _write(self, plans: dict, workdir: Path, say, seed: int) -> None:
        try:
            references.write_references(
                plans, workdir, say, seed, self._cancel, lambda path: self._written.add(str(path))
            )
        except BaseException as exc:  # handed to the main thread by ready()
            self._error = exc

    def ready(self, job) -> bool:
        """Whether ``job`` may start: it reads no reference, or its reference is complete.
        Raises what the writing raised (no space, a shard changed since planned), so the
        run stops as it would have before any engine started."""
        if self._error is not None:
            raise self._error
        return job.model not in self._readers or job.model in self._written

    def close(self) -> None:
        """Stop the writing (a run that ends early) and wait until the thread has ended,
        however long the tensor being written takes: the run removes the workdir next,
        and a thread still writing made it again (write_merged creates its parent) or
        left its staging directory there. A wait of 120 s returned with it writing."""
        self._cancel.set()
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            self._say("stopping the merged references: waiting for the tensor being written")
            self._thread.join()
