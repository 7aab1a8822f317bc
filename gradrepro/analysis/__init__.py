"""Reading many run folders at once: comparison tables (``compare``), the reference report
(``report``), figures, and the experiment catalogue the README shows (``catalog``)."""
