"""torch's backward-compatible call forms of save / load.

``save(state_dict, storage_writer)`` and ``load(state_dict, storage_reader)``
(the argument order before torch 2.2) still work in torch: a UserWarning
says the order changed, and the second argument is taken as the writer /
reader (torch's ``utils._api_bc_check``, private, so dcpx has its own)."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable


def positional_storage(keyword: str) -> Callable:
    """Decorate save (``storage_writer``) or load (``storage_reader``)."""
    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 2:
                warnings.warn(f"The argument order of {func.__name__} has been changed. "
                              "Please check the document to avoid future breakages.",
                              stacklevel=2)
                if keyword in kwargs:
                    raise AssertionError(f"{keyword} in kwargs: {(args, kwargs)}")
                kwargs[keyword] = args[1]
                return func(args[0], **kwargs)
            return func(*args, **kwargs)
        return inner
    return decorate
