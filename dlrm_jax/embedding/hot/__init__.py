"""Hot rows, replicated on every device: lookup statistics (``counts``), when they are counted
and refreshed (``schedule``), the cost model that chooses how many (``planner``), the
replicated rows inside the step (``rows``), and a run's first choice and refreshes
(``refresh``)."""
