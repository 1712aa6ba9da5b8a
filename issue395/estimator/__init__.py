"""The estimator wing: a config.json read as an architecture, Soup's own pre-flight number from
Soup's own code, the corrected physics term by term, the cards and what fits on them, the anatomy
of a peak. Stdlib only: no torch, and Soup is read (with ast), never imported, at module level.
Soup's next release goes in releases; a new card in cards.

Known limitations (measured: results/fit4-anatomy-findmax-render.txt, bench/rerenders.py fit4):

- The adapter blocks' unsplit remainders (the default allocator, the harness's in-process step, hands a
  large-pool request a cached block whole when the rest is 1 MiB or less, and counts the block) are
  charged as a bound, 1 MiB for each adapter-shaped block over 1 MiB live in the binding phase
  (unsplit_remainders, gradient_remainders, transient_remainders): measured, they are 0-22 MB on the fit4
  arms and 166 MiB on Mistral-7B NF4 r256 all-linear's optimizer step, where the charge is 1.67 GB (its setup's
  parameters replayed, the step's blocks bounded), so it reads 1.1925x. Which blocks the allocator
  rounds up is history: a tighter count needs the free list's sizes at the peak. needs_free leaves the
  term out (expandable segments split every block). The binding layer's blocks are charged the same
  rule's bound (layer_remainders: 8.4 MB on Phi-3-mini NF4 512x1, measured 6.3 MB; 13-22 MB on the other
  layer-phase arms; replayed instead where streamed_sequence.walk_replayed admits the run: a small-pool adapter
  on a llama-type decoder, and under NF4 only where no shape runs gemm_4bit fused: on the card the estimate is
  told of (gemm4bit; Mistral-7B NF4 512x1 on an H100 or H200 is walked), else on any card (512x1 keeps the bound)),
  and the loss phase's blocks under 10 MiB (loss_remainders: 1-3 MiB on the committed
  loss-phase arms; Gemma-3-1B NF4 2048x1 3 MiB, its physics alone then 0.02 MB under its measured peak).
- The NF4 setup's replay lays out the r256 history's start segment for segment, but not the r64 one's (the driver
  put some segments elsewhere): placed_rests takes the larger of both placements (12,320,768 B there, the history's
  11,534,336 B). NF4's step replay (nf4_step_rests, Mistral-7B and Llama-3.1-8B SFT) charges the parameters' rests,
  and in a one-step run step 1's gradients'; a later step's gradients (the replay's do not settle from step to
  step), the states and the temporaries (the histories' backward leaves other free blocks than either placement)
  keep the 1 MiB bound, so NF4 large adapters past step 1 read 1.04-1.19x, one-step runs 1.0002x (Llama-3.1-8B
  r64 2048x1) to 1.125x (Mistral-7B r64 1024x1, its optimizer step binding with the states' bound).
- A large adapter's one-step run binds in step 1's optimizer step where the loss is small (Mistral-7B NF4 r64
  all-linear 1024x1: 1.125x of its H200 peak), the states' and transients' rests bounded as above.
- The allocator's reserve (needs_free - split_allocated) is an envelope in whole 20 MiB pages of 8 arms'
  page need and 7 OOM readings (EXPANDABLE_RESERVE_PAGES), not a count of the gaps a run leaves; except a
  checkpointed resident run gc_sequence replays on expandable segments (Phi-3 and llama: both pools' most pages
  over two steps less their allocated peak, never under the reserve their H100 histories measured; phi-2's small
  pool is a page short of its histories, so it is not; gc_sequence.charged).
- Qwen2.5's DPO resident holds 10.1 MB beyond its two adapter copies at r64 all-linear; unattributed
  (no allocator history exists before the step's window).
"""
