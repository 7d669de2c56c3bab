"""Integer arithmetic the modules share: sizes rounded up to whole blocks, pages and pieces."""


def ceil_div(n: int, d: int) -> int:
    """How many units of ``d`` hold ``n`` (``n`` rounded up to a whole number of ``d``)."""
    return -(-n // d)


def round_up(n: int, d: int) -> int:
    """``n`` rounded up to a multiple of ``d``."""
    return ceil_div(n, d) * d
