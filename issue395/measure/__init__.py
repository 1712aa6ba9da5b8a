"""The measure wing: the measurement of one arm: the CUDA peak and the allocator's history,
--measure and --sdpa, Soup's console, the shapes and synthetic checkpoints of the model measured,
where a margin goes, and run_arm, which judges an arm into its row.
"""
