"""Hot rows, replicated on every device, decided on the host: lookup statistics (``counts``),
when they are counted and refreshed (``schedule``), the cost model that chooses how many
(``planner``), and a run's first choice and its refreshes (``refresh``). The replicated rows
inside the step are part of the exchange (``exchange.hot_rows``)."""
