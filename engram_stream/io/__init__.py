"""Files: opening, mapping, atomic writes (files.py)."""
