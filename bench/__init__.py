"""Taktiny's benchmark suite: Taktiny beside Flax NNX, Equinox and PyTorch, as ratios.

Run ``python bench/run.py`` (``make bench``); see ``bench/run.py`` for the options.
"""
