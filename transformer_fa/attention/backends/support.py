"""What every backend's support check shares."""
import functools
from typing import Callable, List

from ..params import AttentionParams


def never_raises(check: Callable[[AttentionParams], List[str]]):
    """A backend's reasons check whose own failure becomes a reason, never an exception in
    the user's face (selection then falls through to the next backend)."""
    @functools.wraps(check)
    def not_supported_reasons(params: AttentionParams) -> List[str]:
        try:
            return check(params)
        except Exception as exc:
            return [f"as its support check failed ({type(exc).__name__}: {exc})"]
    return not_supported_reasons
