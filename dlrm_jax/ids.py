"""The id conventions every layer shares: what a batch's ids hold and the table rows they name.

A batch's ids are table-local row numbers, each feature's bag after the previous feature's;
``PAD_ID`` marks an empty slot of a bag (never a valid row). Data sources write them, the
exchange routes them, serving reads them: this module, at the bottom, is the one home of the
convention, so the exchange needs nothing of ``data/``.
"""

PAD_ID = -1
