"""Update kernels: pure functions over tensor lists, one module per implementation, same three-pass signature."""

from . import eager

__all__ = ["eager"]
