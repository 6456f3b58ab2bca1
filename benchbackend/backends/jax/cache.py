"""JAX's persistent compilation cache, pointed at one cell's folder (``Backend.compile_cache``):
shared by jax and keras-jax, whose steps XLA compiles alike. JAX is imported when a cell asks, so
that keras-torch, in the same adapter module as keras-jax, never imports it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def keep_compiled(folder: Path) -> Callable[[], None]:
    """Keep every XLA executable this process compiles in ``folder``, however quick its compilation
    (JAX's default keeps only those over a second: a small network's never); returns what puts
    the previous settings back (a test runs many cells in one process)."""
    import jax
    from jax._src import compilation_cache

    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    for name, value in zip(_SETTINGS, (str(folder), 0.0, -1)):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # the cache is opened once per process, at its first compilation

    def undo() -> None:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()

    return undo


class KeepsCompiled:
    """jax's and keras-jax's ``compile_cache`` (a mixin before ``Backend``): this cell's XLA
    executables in JAX's persistent cache, the settings put back when the cell closes."""

    _uncache: Callable[[], None] = staticmethod(lambda: None)

    def compile_cache(self) -> Optional[Path]:
        folder = self.cache_folder("jax")  # type: ignore[attr-defined]
        self._uncache = keep_compiled(folder)
        return folder

    def close(self) -> None:
        self._uncache()
        self._uncache = KeepsCompiled._uncache
        super().close()  # type: ignore[misc]
