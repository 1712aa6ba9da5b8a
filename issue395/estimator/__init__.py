"""The estimator wing: a config.json read as an architecture, Soup's own pre-flight number from
Soup's own code, the corrected physics term by term, the cards and what fits on them, the anatomy
of a peak. Stdlib only: no torch, and Soup is read (with ast), never imported, at module level.
Soup's next release goes in releases; a new card in cards.

Known limitations (measured: results/fit4-anatomy-findmax-render.txt, bench/fit4_anatomy.py):

- The corrected peak is the bytes the tensors ask for, every block split to its request: the
  allocated peak under expandable segments (`soup train`, --cap, --emulate-card, --find-max). Without
  them (the harness's in-process step), torch's caching allocator leaves a large-pool block's
  remainder of up to 1 MiB unsplit and counts it as allocated (CUDACachingAllocator should_split:
  remaining > kSmallSize); its history records only the request. Not charged: 0 to 22 MB on the
  fit4 arms, 170-174 MB on Mistral-7B NF4 r256 all-linear's optimizer step (1,792 live adapter
  blocks), and up to 58 MB in the setup's resident bytes of the same arm. The same arm under
  expandable segments: allocated equals requested to 26 KB, and the corrected peak is 1.0005x
  (results/fit4-pages-findmax-stack-*/call-1).
- The allocator's reserve (needs_free - corrected) is an envelope in whole 20 MiB pages of 8 arms'
  page need and 7 OOM readings (EXPANDABLE_RESERVE_PAGES), not a count of the gaps a run leaves.
- Qwen2.5's DPO resident holds 10.1 MB beyond its two adapter copies at r64 all-linear; unattributed
  (no allocator history exists before the step's window).
"""
