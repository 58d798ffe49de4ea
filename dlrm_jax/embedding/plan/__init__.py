"""Planning: tables as specs (``specs``), the planner (``planner``), the plan it makes
(``embedding_plan``), its cost and printed report (``stats``), and the fused arrays a plan
implies (``layout``). Host-side only: nothing here is traced."""
