"""Dynamic tables: raw 64-bit ids mapped to rows without collisions (issue 49)."""
