"""The report wing: fixed-width tables (the sweep, the map, the constrained arms), markdown and
the plots, safe writes.
"""
