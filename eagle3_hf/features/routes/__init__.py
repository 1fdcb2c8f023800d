"""The routes: one module per way to get hidden states, opened only through the table (features/table.py)."""
