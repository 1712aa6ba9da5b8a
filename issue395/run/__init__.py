"""The run wing: the command line (parser, checks, the user's soup.yaml, settle), the grid of
arms, the scratch folder and checkpoint cache, children and shards, --min-free's probes, and the
runner.
"""
