"""The model wing: every model by key (the registry: a new family goes here), Soup's LoRA target
spellings, and the arm, one point of a grid with Soup's prediction for it. Stdlib only.
"""
