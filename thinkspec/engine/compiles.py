"""Triton JIT compilations counted as they happen: a step (or a timed run) during which the count
grows paid for a compile, so its time is no sample of the steady state.
"""

from __future__ import annotations

from typing import Any

_compiles = 0  # Triton compilations seen by the hook below since it was installed
_hook_installed = False
_no_hook = False  # an earlier call found no hook to install: do not import again
_recent: list[str] = []  # what the last compilations built (kernel and specialization), newest last
RECENT = 8


def _count_compile(previous: Any) -> Any:
    def hook(*args: Any, **kwargs: Any) -> Any:
        global _compiles
        _compiles += 1
        _recent.append(_describe(kwargs))
        del _recent[:-RECENT]
        return previous(*args, **kwargs) if previous is not None else None

    return hook


def _describe(hook_kwargs: dict[str, Any]) -> str:
    """One line: the kernel and its launch options (Triton's description up to the arguments, which
    some Triton versions leave out) and the compile key: each argument's type and what Triton
    specialised it on (an integer 1, divisible by 16, an aligned pointer), and the constexprs."""
    text = str(hook_kwargs.get("repr", "?"))
    head = text.split("](", 1)[0] + "]" if "](" in text else text.split("(", 1)[0]
    return " ".join(f"{head} {hook_kwargs.get('key', '')}".split())[:1200]


def install_compile_hook() -> bool:
    """Count every Triton JIT compilation in this process from now on (chaining any hook already
    set); False when there is no Triton, or it has no post-compile hook."""
    global _hook_installed, _no_hook
    if _hook_installed or _no_hook:
        return _hook_installed
    try:
        from triton import knobs
    except ImportError:
        _no_hook = True
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        _no_hook = True
        return False
    runtime.jit_post_compile_hook = _count_compile(runtime.jit_post_compile_hook)
    _hook_installed = True
    return True


def compile_count() -> int | None:
    """Triton compilations since the hook was installed (installing it on first call); None when
    this Triton has no post-compile hook."""
    return _compiles if install_compile_hook() else None


def recent_compiles(n: int) -> list[str]:
    """What the last n (at most RECENT) compilations built: kernel, launch options and the argument
    specialization, as Triton describes them (to find the shape a warm-up missed)."""
    return _recent[-n:] if n > 0 else []
