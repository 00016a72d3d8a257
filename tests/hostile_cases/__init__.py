"""Hostile cases by surface; ``tests/hostile_sweep.py`` loads each file's ``build(hs)``."""
