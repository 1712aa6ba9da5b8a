"""The machinery behind issue395_second_stack_vram.py: everything that is not the protocol.

In wings, bottom-up: model, estimator, results, constraints, measure, report, run, over the
root's constants, errors and record; each module imports only what lies below it (docs/LAYOUT.md).
The package never imports the entry script: the script hands its measured arm in.
"""
