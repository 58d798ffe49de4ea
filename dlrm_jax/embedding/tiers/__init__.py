"""Tiered tables, larger than device memory. Host side: the disk tier (``store``, ``format``,
``snapshots``), the DRAM caches (``dram_cache``), the planner of device-cache slots
(``cache_planner``), a run's tiered tables, their fill programs, set-up and train steps
(``tables``, ``fill_programs``, ``setup``, ``runner``), and hot rows of tiered tables (``hot``).
Inside the jitted step: the device-cache fills (``device_fill``)."""
