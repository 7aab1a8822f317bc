"""A markdown table that fits a terminal: a table wider than ``width`` characters is split
into consecutive blocks of columns, each repeating the first column (the run or the group it
describes), and a cell longer than ``MAX_CELL`` is shortened: a path keeps its end (a run
folder's distinctive part, ``.../seed=1``) behind an ellipsis, prose (a paper's words) keeps
its start, as it is read. The long forms stay in ``--wide`` and in the csv."""

from __future__ import annotations

from typing import List

import pandas as pd

WIDTH = 120  # a terminal's columns (a common default width of terminals and of code review)
MAX_CELL = 40  # the longest cell kept whole, so that at least two columns fit beside the key


def markdown(df: pd.DataFrame, **kwargs) -> str:
    """``df.to_markdown(index=False, ...)`` with every ``|`` in a cell or a column name escaped
    (``\\|``, as GitHub's tables read it): a quantity such as ``|log2(x)|`` stays in its cell,
    and a reader that splits on unescaped pipes gets the table's columns back."""
    def escape(value: object) -> object:
        return value.replace("|", "\\|") if isinstance(value, str) else value

    shown = df.rename(columns=lambda c: escape(str(c)))
    for col in shown.columns:
        if not pd.api.types.is_numeric_dtype(shown[col]):
            shown[col] = shown[col].map(escape)
    return shown.to_markdown(index=False, **kwargs)


def _shorten(value: object) -> object:
    text = str(value)
    if len(text) <= MAX_CELL:
        return value
    if "/" in text and " " not in text:  # a path: its end tells runs apart
        return "…" + text[-(MAX_CELL - 1):]
    return text[:MAX_CELL - 1] + "…"


def markdown_within(df: pd.DataFrame, width: int = WIDTH) -> str:
    """``df`` (text cells, as ``for_reading`` makes them) as one or more markdown tables, each
    at most ``width`` characters wide where its columns allow."""
    if df.empty or len(df.columns) == 0:
        return markdown(df)
    df = df.copy()
    for col in df.columns:
        df[col] = df[col].map(_shorten)
    whole = markdown(df, missingval="")
    if max(len(line) for line in whole.splitlines()) <= width:
        return whole
    key, rest = df.columns[0], list(df.columns[1:])
    blocks: List[List[object]] = [[]]
    for col in rest:  # greedy, measured as rendered (tabulate's padding is its own)
        if blocks[-1] and _width(df[[key, *blocks[-1], col]]) > width:
            blocks.append([])
        blocks[-1].append(col)
    return "\n\n".join(markdown(df[[key, *cols]], missingval="") for cols in blocks)


def _width(df: pd.DataFrame) -> int:
    return max(len(line) for line in markdown(df, missingval="").splitlines())
