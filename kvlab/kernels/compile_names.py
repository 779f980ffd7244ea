"""Distinct names for two compiles of one kernel, so numba's disk cache keeps them apart."""

from __future__ import annotations

from types import FunctionType


def renamed(func: FunctionType, name: str) -> FunctionType:
    """`func` under another name. numba's disk cache finds a function by its qualified name, source line
    and bytecode, not by its compile flags: a parallel and a serial compile of one function share cache
    files, and each loads whichever was stored first (measured: the "serial" decode-attention kernel,
    loaded from a cache the parallel one had filled, took 4.5x longer at 4096 keys on a busy 2-core
    machine)."""
    clone = FunctionType(func.__code__, func.__globals__, name, func.__defaults__, func.__closure__)
    clone.__qualname__ = name
    return clone
