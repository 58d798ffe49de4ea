"""Hot rows, replicated on every device, decided on the host: lookup statistics (``counts``),
when they are counted and refreshed (``schedule``), the cost model that chooses how many
(``choice``), and the index that finds a hot id's row (``index``: built on the host, read in the
step). A run's first choice is ``train.hot_setup``; the replicated rows inside the step are part
of the exchange (``exchange.hot_rows``), which reads this package."""
