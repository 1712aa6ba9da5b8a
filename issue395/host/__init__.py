"""The host a measured run uses: what it asks for (``MeasureRequest``), its arms in order (the grid), this
process's arms, the scratch folder and the checkpoint cache, the card's bytes between lanes (the packing's rules and
the ledgers across processes), its children, shards and lanes, and --min-free's probes. The command line and the
modes (issue395.run) settle a request and hand it here."""
