"""The in-process engine: the three roles wired together in one process (generate, bench, model building, serve --inprocess)."""
