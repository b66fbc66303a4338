"""``RNGState``: this process's random generators as one ``Stateful`` (Python, NumPy, torch).

Generators are per process: save one as ``PerRankState("rng", RNGState(), rank, world_size)``
so that every rank gets its own streams back. The stored form holds only tensors, ints,
floats and tuples, so it loads with ``weights_only`` safety.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dcpbridge.errors import DataStateError

_KEYS = frozenset({"python", "numpy", "torch", "cuda"})
_MT_WORDS = 624  # words of NumPy's legacy generator's key (Mersenne Twister)


class RNGState:
    """Python ``random``, NumPy's global generator, torch's CPU generator and, where CUDA is
    available, every CUDA device's generator."""

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now."""
        name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {
            "python": random.getstate(),
            "numpy": (str(name), torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": list(cuda),
        }

    def load_state_dict(self, state_dict: Any) -> None:
        """Set every generator to a stored state (checked: it comes from storage)."""
        python, np_state, cpu, cuda = _checked(state_dict)
        saved = _current()  # all or nothing: a state that fails puts every one back
        try:
            try:
                random.setstate(python)
                np.random.set_state(np_state)
                torch.set_rng_state(cpu)
                if cuda:
                    torch.cuda.set_rng_state_all(cuda)
            except BaseException:
                _restore(saved)
                raise
        except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as e:
            raise DataStateError(f"RNG state cannot be restored: {e}") from e

    def _check_state_dict(self, state_dict: Any) -> None:
        """Raise ``DataStateError`` where ``load_state_dict`` would refuse ``state_dict``
        before setting anything (a load checks every state before it changes any)."""
        _checked(state_dict)


def _checked(state_dict: Any) -> tuple[Any, tuple[Any, ...], torch.Tensor, list[torch.Tensor]]:
    """A stored state's (Python, NumPy, torch, CUDA) parts, each checked as far as it can be
    without setting it; ``DataStateError`` naming what is wrong."""
    if not isinstance(state_dict, Mapping) or set(state_dict) != _KEYS:
        got = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict)
        raise DataStateError(f"RNG state must be a mapping with keys {sorted(_KEYS)}: {got!r}")
    cuda = state_dict["cuda"]
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not isinstance(cuda, list) or (cuda and len(cuda) != devices):
        raise DataStateError(
            f"the RNG state holds {len(cuda) if isinstance(cuda, list) else '?'} CUDA "
            f"generator(s) and this process sees {devices} device(s)"
        )
    try:
        name, key, pos, has_gauss, gauss = state_dict["numpy"]
        if not isinstance(key, torch.Tensor) or key.dtype != torch.int64:
            raise TypeError(f"numpy key must be an int64 tensor, got {type(key).__name__}")
        if key.shape != (_MT_WORDS,):
            raise ValueError(f"numpy key must hold {_MT_WORDS} words, got {list(key.shape)}")
        if int(key.min()) < 0 or int(key.max()) >= 1 << 32:
            # uint32 words: astype would keep only the low 32 bits of each, silently
            raise ValueError("numpy key holds words outside [0, 2**32)")
        if type(pos) is not int or not 0 <= pos <= _MT_WORDS:
            # NumPy takes any position; its next draw would read outside the key
            raise ValueError(f"numpy position {pos!r} is outside [0, {_MT_WORDS}]")
        if not _finite(gauss):  # NumPy takes NaN or infinity: its next normal draw
            raise ValueError(f"numpy cached gaussian {gauss!r} is not a finite number")
        np_state = (name, key.numpy().astype(np.uint32), pos, has_gauss, gauss)
        for what, check in (("torch", state_dict["torch"]), *(("cuda", c) for c in cuda)):
            if not isinstance(check, torch.Tensor) or check.dtype != torch.uint8:
                raise TypeError(f"{what} state must be a uint8 tensor")
        if not _torch_normals_finite(state_dict["torch"]):  # torch takes NaN there too
            raise ValueError("torch cached normal sample is not a finite number")
        python = state_dict["python"]
        if _wide_words(python):  # random.setstate keeps each word's low 32 bits, silently
            raise ValueError("python state holds words outside [0, 2**32)")
        if (
            isinstance(python, tuple)
            and len(python) == 3
            and not (python[2] is None or _finite(python[2]))
        ):  # random.setstate takes any object: the next random.gauss() returns it
            raise ValueError(f"python cached gaussian {python[2]!r} is not a finite number")
        return python, np_state, state_dict["torch"], cuda
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as e:
        raise DataStateError(f"RNG state cannot be restored: {e}") from e


def _wide_words(python: Any) -> bool:
    """Whether a stored ``random.getstate()`` holds Mersenne Twister words (all but the last
    entry of its state tuple, the position) outside uint32."""
    if not (isinstance(python, tuple) and len(python) == 3 and isinstance(python[1], tuple)):
        return False  # not a state: random.setstate refuses it
    return any(type(w) is int and not 0 <= w < 1 << 32 for w in python[1][:-1])


def _finite(value: Any) -> bool:
    """Whether ``value`` is a number a generator caches as its next normal sample."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_TORCH_STATE_BYTES = 5056  # torch's CPU generator state, in the layout read below


def _torch_normals_finite(state: torch.Tensor) -> bool:
    """Whether a stored torch CPU generator state's cached normal samples, where it marks
    them valid, are finite: the doubles ``normal_x``, ``normal_y``, ``normal_rho`` (flag at
    byte 5040) and the float at byte 5048 (flag at 5052). A state of another size (another
    layout) is left to torch."""
    if state.dim() != 1 or state.numel() != _TORCH_STATE_BYTES:
        return True
    raw = state.contiguous().numpy().tobytes()
    doubles = np.frombuffer(raw, dtype=np.float64, count=3, offset=5016)
    if (
        np.frombuffer(raw, dtype=np.int32, count=1, offset=5040)[0]
        and not np.isfinite(doubles).all()
    ):
        return False
    single = np.frombuffer(raw, dtype=np.float32, count=1, offset=5048)
    return not (raw[5052] and not np.isfinite(single).all())


def _current() -> tuple[Any, Any, torch.Tensor, list[torch.Tensor]]:
    """This process's generators' states (Python, NumPy, torch, every CUDA device's)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _restore(saved: tuple[Any, Any, torch.Tensor, list[torch.Tensor]]) -> None:
    python, numpy, cpu, cuda = saved
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
