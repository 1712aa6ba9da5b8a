"""The estimator wing: a config.json read as an architecture, Soup's own pre-flight number from
Soup's own code, the corrected physics term by term, the cards and what fits on them, the anatomy
of a peak. Stdlib only: no torch, and Soup is read (with ast), never imported, at module level.
Soup's next release goes in releases; a new card in cards.
"""
